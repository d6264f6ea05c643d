// Values of the Jinja interpreter: Python str()/repr()/==/< and json.dumps formatting.
#include "chat/jinja_value.h"

#include "core/utf8.h"

#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace ds::jinja {

// ---------------------------------------------------------------------------------------------
// UTF-8

std::vector<uint32_t> utf8_decode(std::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    utf8proc_int32_t cp = 0;
    utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                          static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
    if (n <= 0) {
      out.push_back(0xFFFD);
      i += 1;
    } else {
      out.push_back(static_cast<uint32_t>(cp));
      i += static_cast<size_t>(n);
    }
  }
  return out;
}

void utf8_append(std::string& out, uint32_t cp) {
  append_utf8(out, cp);
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

bool is_python_space(uint32_t cp) {
  if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x1F)) return true;
  if (cp < 0x85) return false;
  if (cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A)) return true;
  return cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

namespace {

bool python_printable(uint32_t cp) {
  if (cp == ' ') return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS:
      return false;
    default:
      return true;
  }
}

std::string python_string_repr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (uint32_t cp : utf8_decode(s)) {
    char buf[16];
    if (cp == static_cast<uint32_t>(quote) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (python_printable(cp)) {
      utf8_append(out, cp);
    } else if (cp < 0x100) {
      std::snprintf(buf, sizeof buf, "\\x%02x", cp);
      out += buf;
    } else if (cp < 0x10000) {
      std::snprintf(buf, sizeof buf, "\\u%04x", cp);
      out += buf;
    } else {
      std::snprintf(buf, sizeof buf, "\\U%08x", cp);
      out += buf;
    }
  }
  out += quote;
  return out;
}

void json_escape(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

}  // namespace

std::string python_float_repr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  std::string sign = std::signbit(f) ? "-" : "";
  if (f == 0) return sign + "0.0";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, std::fabs(f), std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // d[.ddd]e[+-]XX, shortest round-trip digits
  size_t epos = sci.find('e');
  std::string digits;
  for (size_t i = 0; i < epos; ++i)
    if (sci[i] != '.') digits += sci[i];
  int exp10 = std::stoi(sci.substr(epos + 1));
  int decpt = exp10 + 1;
  std::string out = sign;
  if (decpt <= -4 || decpt > 16) {
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    out += eb;
  } else if (decpt <= 0) {
    out += "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
  } else if (static_cast<size_t>(decpt) >= digits.size()) {
    out += digits + std::string(static_cast<size_t>(decpt) - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, static_cast<size_t>(decpt)) + "." +
           digits.substr(static_cast<size_t>(decpt));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Dict

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Dict::set(const std::string& key, Value v) {
  for (auto& [k, old] : items) {
    if (k == key) {
      old = std::move(v);
      return;
    }
  }
  items.emplace_back(key, std::move(v));
}

// ---------------------------------------------------------------------------------------------
// Value construction and access

Value Value::undefined(std::string hint) {
  Value v;
  if (!hint.empty()) v.p_ = std::make_shared<const std::string>(std::move(hint));
  return v;
}
Value Value::none() {
  Value v;
  v.type_ = Type::kNone;
  return v;
}
Value Value::boolean(bool b) {
  Value v;
  v.type_ = Type::kBool;
  v.i_ = b ? 1 : 0;
  return v;
}
Value Value::integer(int64_t i) {
  Value v;
  v.type_ = Type::kInt;
  v.i_ = i;
  return v;
}
Value Value::floating(double f) {
  Value v;
  v.type_ = Type::kFloat;
  v.f_ = f;
  return v;
}
Value Value::string(std::string s) {
  Value v;
  v.type_ = Type::kString;
  v.p_ = std::make_shared<const std::string>(std::move(s));
  return v;
}
Value Value::list(ValueList items, bool tuple) {
  Value v;
  v.type_ = Type::kList;
  v.tuple_ = tuple;
  v.p_ = std::make_shared<const ValueList>(std::move(items));
  return v;
}
Value Value::dict(Dict d) {
  Value v;
  v.type_ = Type::kDict;
  v.p_ = std::make_shared<const Dict>(std::move(d));
  return v;
}
Value Value::make_namespace(Dict attrs) {
  Value v;
  v.type_ = Type::kNamespace;
  v.p_ = std::make_shared<Namespace>(Namespace{std::move(attrs)});
  return v;
}
Value Value::function(std::string name, std::function<Value(CallArgs&)> fn) {
  Value v;
  v.type_ = Type::kFunction;
  v.p_ = std::make_shared<const Function>(Function{std::move(name), std::move(fn)});
  return v;
}

namespace {
constexpr int kMaxJsonDepth = 256;  // deeper request JSON is refused (recursion below is bounded)
}

Value Value::from_json(const nlohmann::ordered_json& j) { return from_json_depth(j, 0); }

Value Value::from_json_depth(const nlohmann::ordered_json& j, int depth) {
  using J = nlohmann::ordered_json::value_t;
  if (depth > kMaxJsonDepth)
    throw_error("chat template input is nested deeper than ", kMaxJsonDepth, " levels");
  switch (j.type()) {
    case J::null:
      return none();
    case J::boolean:
      return boolean(j.get<bool>());
    case J::number_integer:
      return integer(j.get<int64_t>());
    case J::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX))
        throw_error("integer ", u, " is too large for a chat template");
      return integer(static_cast<int64_t>(u));
    }
    case J::number_float:
      return floating(j.get<double>());
    case J::string:
      return string(j.get<std::string>());
    case J::array: {
      ValueList items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json_depth(e, depth + 1));
      return list(std::move(items));
    }
    case J::object: {
      Dict d;
      d.items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it)
        d.items.emplace_back(it.key(), from_json_depth(it.value(), depth + 1));
      return dict(std::move(d));
    }
    default:
      throw_error("chat template input: unsupported JSON value (binary or discarded)");
  }
}

static const std::string kEmpty;

const std::string& Value::as_string() const {
  return p_ && (type_ == Type::kString || type_ == Type::kUndefined)
             ? *static_cast<const std::string*>(p_.get())
             : kEmpty;
}
const ValueList& Value::as_list() const { return *static_cast<const ValueList*>(p_.get()); }
const Dict& Value::as_dict() const { return *static_cast<const Dict*>(p_.get()); }
Namespace& Value::as_namespace() const {
  return *const_cast<Namespace*>(static_cast<const Namespace*>(p_.get()));
}
const Function& Value::as_function() const { return *static_cast<const Function*>(p_.get()); }

bool Value::truthy() const {
  switch (type_) {
    case Type::kUndefined:
    case Type::kNone:
      return false;
    case Type::kBool:
    case Type::kInt:
      return i_ != 0;
    case Type::kFloat:
      return f_ != 0;
    case Type::kString:
      return !as_string().empty();
    case Type::kList:
      return !as_list().empty();
    case Type::kDict:
      return !as_dict().items.empty();
    default:
      return true;
  }
}

std::string Value::str() const {
  switch (type_) {
    case Type::kUndefined:
      return "";
    case Type::kString:
      return as_string();
    default:
      return repr();
  }
}

std::string Value::repr() const {
  switch (type_) {
    case Type::kUndefined:
      return "Undefined";
    case Type::kNone:
      return "None";
    case Type::kBool:
      return i_ ? "True" : "False";
    case Type::kInt:
      return std::to_string(i_);
    case Type::kFloat:
      return python_float_repr(f_);
    case Type::kString:
      return python_string_repr(as_string());
    case Type::kList: {
      const ValueList& l = as_list();
      std::string out = tuple_ ? "(" : "[";
      for (size_t i = 0; i < l.size(); ++i) {
        if (i) out += ", ";
        out += l[i].repr();
      }
      if (tuple_ && l.size() == 1) out += ",";
      out += tuple_ ? ")" : "]";
      return out;
    }
    case Type::kDict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, v] : as_dict().items) {
        if (!first) out += ", ";
        first = false;
        out += python_string_repr(k) + ": " + v.repr();
      }
      return out + "}";
    }
    case Type::kNamespace:
      return "<Namespace " + Value::dict(as_namespace().attrs).repr() + ">";
    case Type::kFunction:
      return "<function " + as_function().name + ">";
  }
  return "";
}

std::string Value::type_name() const {
  switch (type_) {
    case Type::kUndefined:
      return "Undefined";
    case Type::kNone:
      return "NoneType object";
    case Type::kBool:
      return "bool object";
    case Type::kInt:
      return "int object";
    case Type::kFloat:
      return "float object";
    case Type::kString:
      return "str object";
    case Type::kList:
      return tuple_ ? "tuple object" : "list object";
    case Type::kDict:
      return "dict object";
    case Type::kNamespace:
      return "Namespace object";
    case Type::kFunction:
      return "function object";
  }
  return "object";
}

namespace {

void to_json_rec(const Value& v, const JsonOptions& opt, int level, std::string& out) {
  auto newline = [&](int lvl) {
    out += '\n';
    for (int i = 0; i < lvl; ++i) out += opt.indent;
  };
  switch (v.type()) {
    case Type::kNone:
      out += "null";
      return;
    case Type::kBool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Type::kInt:
      out += std::to_string(v.as_int());
      return;
    case Type::kFloat: {
      double f = v.as_float();
      if (std::isnan(f))
        out += "NaN";
      else if (std::isinf(f))
        out += f > 0 ? "Infinity" : "-Infinity";
      else
        out += python_float_repr(f);
      return;
    }
    case Type::kString:
      json_escape(out, v.as_string());
      return;
    case Type::kList: {
      const ValueList& l = v.as_list();
      if (l.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < l.size(); ++i) {
        if (i) out += opt.item_sep;
        if (opt.pretty) newline(level + 1);
        to_json_rec(l[i], opt, level + 1, out);
      }
      if (opt.pretty) newline(level);
      out += ']';
      return;
    }
    case Type::kDict: {
      const Dict& d = v.as_dict();
      if (d.items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : d.items) items.push_back(&kv);
      if (opt.sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += opt.item_sep;
        if (opt.pretty) newline(level + 1);
        json_escape(out, items[i]->first);
        out += opt.key_sep;
        to_json_rec(items[i]->second, opt, level + 1, out);
      }
      if (opt.pretty) newline(level);
      out += '}';
      return;
    }
    default:
      throw_error("Object of type ", v.is_undefined() ? "Undefined" : v.type_name(),
                  " is not JSON serializable");
  }
}

}  // namespace

std::string Value::to_json(const JsonOptions& opt) const {
  std::string out;
  to_json_rec(*this, opt, 0, out);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Comparison

bool values_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case Type::kUndefined:
    case Type::kNone:
      return true;
    case Type::kString:
      return a.as_string() == b.as_string();
    case Type::kList: {
      if (a.is_tuple() != b.is_tuple()) return false;
      const ValueList& x = a.as_list();
      const ValueList& y = b.as_list();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!values_equal(x[i], y[i])) return false;
      return true;
    }
    case Type::kDict: {
      const Dict& x = a.as_dict();
      const Dict& y = b.as_dict();
      if (x.items.size() != y.items.size()) return false;
      for (const auto& [k, v] : x.items) {
        const Value* o = y.find(k);
        if (!o || !values_equal(v, *o)) return false;
      }
      return true;
    }
    case Type::kNamespace:
      return &a.as_namespace() == &b.as_namespace();
    case Type::kFunction:
      return &a.as_function() == &b.as_function();
    default:
      return false;
  }
}

int compare_values(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      double x = a.as_float(), y = b.as_float();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    return a.as_int() < b.as_int() ? -1 : (a.as_int() > b.as_int() ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    int c = a.as_string().compare(b.as_string());  // UTF-8 byte order == code point order
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple()) {
    const ValueList& x = a.as_list();
    const ValueList& y = b.as_list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (values_equal(x[i], y[i])) continue;
      return compare_values(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  throw_error("'<' not supported between instances of '", a.type_name(), "' and '", b.type_name(),
              "'");
}

}  // namespace ds::jinja
