// Jinja evaluator: renders the AST with jinja2's runtime semantics as the chat templates see them
// (default Undefined, per-iteration loop scopes, macros as closures over their defining scope,
// namespace() as the one mutable object, ImmutableSandboxedEnvironment attribute rules), plus
// jinja2's filters and tests, the Python str / dict / list methods, and transformers' globals.
#include <utf8proc.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "chat/jinja_ast.h"

namespace ds {

TemplateError::TemplateError(const std::string& message, int line, int column, bool raised)
    : Error(raised ? message
                   : "line " + std::to_string(line) + ", column " + std::to_string(column) + ": " +
                         message),
      message_(message),
      line_(line),
      column_(column),
      raised_(raised) {}

namespace jinja {
namespace {

constexpr int kMaxCallDepth = 256;
constexpr int64_t kMaxRange = 100000;  // jinja2.sandbox.MAX_RANGE
// Loop iterations of one render at most: ranges are capped one by one, but nested loops are not
// (range(10000) inside range(10000) ran for minutes on a request thread). Real chat templates
// take thousands (messages x tools x parameters).
constexpr int64_t kMaxLoopSteps = 2000000;

struct Scope;
using ScopePtr = std::shared_ptr<Scope>;

struct Scope {
  ScopePtr parent;
  std::vector<std::pair<std::string, Value>> vars;
  explicit Scope(ScopePtr p) : parent(std::move(p)) {}
  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get())
      for (auto it = s->vars.rbegin(); it != s->vars.rend(); ++it)
        if (it->first == name) return &it->second;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, old] : vars) {
      if (k == name) {
        old = std::move(v);
        return;
      }
    }
    vars.emplace_back(name, std::move(v));
  }
};

enum class Flow { kNormal, kBreak, kContinue };

class Renderer;
using FilterFn = Value (*)(Renderer&, const Value&, CallArgs&);
using TestFn = bool (*)(Renderer&, const Value&, CallArgs&);
const std::unordered_map<std::string, FilterFn>& filters();
const std::unordered_map<std::string, TestFn>& tests();

// ---------------------------------------------------------------------------------------------
// Small Python helpers on UTF-8 strings

std::string from_cps(const std::vector<uint32_t>& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) utf8_append(out, cps[i]);
  return out;
}

// Code point starting at byte i of s (U+FFFD for an invalid byte); *len gets its byte length.
uint32_t decode_at(const std::string& s, size_t i, size_t* len) {
  auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) {
    *len = 1;
    return c;
  }
  utf8proc_int32_t cp = 0;
  utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                        static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
  *len = n > 0 ? static_cast<size_t>(n) : 1;
  return n > 0 ? static_cast<uint32_t>(cp) : 0xFFFD;
}

// str.strip / lstrip / rstrip; only the ends are decoded.
std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  std::vector<uint32_t> set;
  bool ws = chars.is_none() || chars.is_undefined();
  if (!ws) set = utf8_decode(chars.as_string());
  auto strip_me = [&](uint32_t c) {
    return ws ? is_python_space(c) : std::find(set.begin(), set.end(), c) != set.end();
  };
  size_t b = 0, e = s.size(), len = 0;
  if (left)
    while (b < e && strip_me(decode_at(s, b, &len))) b += len;
  if (right) {
    while (e > b) {
      size_t p = e - 1;  // start of the last code point
      while (p > b && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80 && e - p < 4) --p;
      if (!strip_me(decode_at(s, p, &len)) || p + len != e) break;
      e = p;
    }
  }
  if (b == 0 && e == s.size()) return s;
  return s.substr(b, e - b);
}

std::vector<std::string> py_split_ws(const std::string& s, int64_t maxsplit) {
  std::vector<uint32_t> cps = utf8_decode(s);
  std::vector<std::string> out;
  size_t i = 0, n = cps.size();
  while (true) {
    while (i < n && is_python_space(cps[i])) ++i;
    if (i >= n) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
      out.push_back(from_cps(cps, i, n));  // the remainder keeps its trailing whitespace
      break;
    }
    size_t j = i;
    while (j < n && !is_python_space(cps[j])) ++j;
    out.push_back(from_cps(cps, i, j));
    i = j;
  }
  return out;
}

std::vector<std::string> py_rsplit_ws(const std::string& s, int64_t maxsplit) {
  std::vector<uint32_t> cps = utf8_decode(s);
  std::vector<std::string> out;
  size_t e = cps.size();
  while (true) {
    while (e > 0 && is_python_space(cps[e - 1])) --e;
    if (e == 0) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
      out.push_back(from_cps(cps, 0, e));  // the remainder keeps its leading whitespace
      break;
    }
    size_t b = e;
    while (b > 0 && !is_python_space(cps[b - 1])) --b;
    out.push_back(from_cps(cps, b, e));
    e = b;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> py_split(const std::string& s, const std::string& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  size_t start = 0;
  while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
    size_t p = s.find(sep, start);
    if (p == std::string::npos) break;
    out.push_back(s.substr(start, p - start));
    start = p + sep.size();
  }
  out.push_back(s.substr(start));
  return out;
}

std::vector<std::string> py_rsplit(const std::string& s, const std::string& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  size_t end = s.size();
  while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
    if (end < sep.size()) break;
    size_t p = s.rfind(sep, end - sep.size());
    if (p == std::string::npos) break;
    out.push_back(s.substr(p + sep.size(), end - p - sep.size()));
    end = p;
  }
  out.push_back(s.substr(0, end));
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> py_splitlines(const std::string& s, bool keepends) {
  std::vector<uint32_t> cps = utf8_decode(s);
  std::vector<std::string> out;
  size_t b = 0, i = 0, n = cps.size();
  while (i < n) {
    uint32_t c = cps[i];
    bool brk = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || (c >= 0x1C && c <= 0x1E) ||
               c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!brk) {
      ++i;
      continue;
    }
    size_t eol = i + ((c == '\r' && i + 1 < n && cps[i + 1] == '\n') ? 2 : 1);
    out.push_back(from_cps(cps, b, keepends ? eol : i));
    b = i = eol;
  }
  if (b < n) out.push_back(from_cps(cps, b, n));
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl,
                       int64_t count) {
  std::string out;
  if (old.empty()) {  // inserts repl around every code point
    std::vector<uint32_t> cps = utf8_decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      if (i < cps.size()) utf8_append(out, cps[i]);
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t p = s.find(old, start);
    if (p == std::string::npos) break;
    out.append(s, start, p - start);
    out += repl;
    start = p + old.size();
    ++done;
  }
  out.append(s, start, std::string::npos);
  return out;
}

std::string map_case(const std::string& s, int mode) {  // 0 lower, 1 upper
  std::string out;
  for (uint32_t c : utf8_decode(s)) {
    auto cp = static_cast<utf8proc_int32_t>(c);
    utf8_append(out, static_cast<uint32_t>(mode ? utf8proc_toupper(cp) : utf8proc_tolower(cp)));
  }
  return out;
}

bool is_cased_letter(uint32_t c) {
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}
bool is_alpha(uint32_t c) {
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
}
bool is_decimal(uint32_t c) {
  return utf8proc_category(static_cast<utf8proc_int32_t>(c)) == UTF8PROC_CATEGORY_ND;
}
bool is_numeric(uint32_t c) {
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
}

std::string py_capitalize(const std::string& s) {
  std::vector<uint32_t> cps = utf8_decode(s);
  std::string out;
  for (size_t i = 0; i < cps.size(); ++i) {
    auto cp = static_cast<utf8proc_int32_t>(cps[i]);
    utf8_append(out, static_cast<uint32_t>(i == 0 ? utf8proc_totitle(cp) : utf8proc_tolower(cp)));
  }
  return out;
}

std::string py_title(const std::string& s) {  // str.title()
  std::string out;
  bool prev_cased = false;
  for (uint32_t c : utf8_decode(s)) {
    auto cp = static_cast<utf8proc_int32_t>(c);
    bool cased = is_cased_letter(c);
    utf8_append(out, static_cast<uint32_t>(
                         cased ? (prev_cased ? utf8proc_tolower(cp) : utf8proc_totitle(cp)) : cp));
    prev_cased = cased;
  }
  return out;
}

int64_t add_i(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) throw_error("integer overflow in template arithmetic");
  return r;
}
int64_t sub_i(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_sub_overflow(a, b, &r)) throw_error("integer overflow in template arithmetic");
  return r;
}
int64_t mul_i(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) throw_error("integer overflow in template arithmetic");
  return r;
}

double py_fmod(double a, double b) {
  double m = std::fmod(a, b);
  if (m != 0 && ((b < 0) != (m < 0))) m += b;
  return m;
}

// ---------------------------------------------------------------------------------------------
// Argument binding for filters, tests, methods and globals

class Args {
 public:
  Args(const char* fn, CallArgs& a, std::initializer_list<const char*> names) : names_(names) {
    vals_.resize(names_.size());
    given_.resize(names_.size(), false);
    if (a.args.size() > names_.size())
      throw_error(fn, "() takes at most ", names_.size(), " argument(s) (", a.args.size(),
                  " given)");
    for (size_t i = 0; i < a.args.size(); ++i) {
      vals_[i] = a.args[i];
      given_[i] = true;
    }
    for (auto& [k, v] : a.kwargs) {
      size_t i = 0;
      while (i < names_.size() && k != names_[i]) ++i;
      if (i == names_.size()) throw_error(fn, "() got an unexpected keyword argument '", k, "'");
      if (given_[i]) throw_error(fn, "() got multiple values for argument '", k, "'");
      vals_[i] = v;
      given_[i] = true;
    }
  }
  const Value& operator[](size_t i) const { return vals_[i]; }
  bool has(size_t i) const { return given_[i]; }
  // Python default of None counts as absent.
  bool present(size_t i) const { return given_[i] && !vals_[i].is_none(); }

 private:
  std::vector<const char*> names_;
  ValueList vals_;
  std::vector<bool> given_;
};

int64_t int_arg(const Value& v, const char* what) {
  if (v.is_int() || v.is_bool()) return v.as_int();
  throw_error(what, " must be an integer, not ", v.type_name());
}
const std::string& str_arg(const Value& v, const char* what) {
  if (!v.is_string()) throw_error(what, " must be a string, not ", v.type_name());
  return v.as_string();
}

// Items of an iterable: list items, dict keys, string code points; undefined is empty.
ValueList iterate(const Value& v) {
  switch (v.type()) {
    case Type::kUndefined:
      return {};
    case Type::kList:
      return v.as_list();
    case Type::kDict: {
      ValueList keys;
      for (const auto& kv : v.as_dict().items) keys.push_back(Value::string(kv.first));
      return keys;
    }
    case Type::kString: {
      ValueList chars;
      for (uint32_t c : utf8_decode(v.as_string())) {
        std::string s;
        utf8_append(s, c);
        chars.push_back(Value::string(std::move(s)));
      }
      return chars;
    }
    default:
      throw_error("'", v.type_name(), "' is not iterable");
  }
}

int64_t py_len(const Value& v) {
  switch (v.type()) {
    case Type::kUndefined:
      return 0;
    case Type::kString:
      return static_cast<int64_t>(utf8_length(v.as_string()));
    case Type::kList:
      return static_cast<int64_t>(v.as_list().size());
    case Type::kDict:
      return static_cast<int64_t>(v.as_dict().items.size());
    default:
      throw_error("object of type '", v.type_name(), "' has no len()");
  }
}

bool contains(const Value& container, const Value& item) {
  switch (container.type()) {
    case Type::kUndefined:
      return false;
    case Type::kString:
      if (!item.is_string())
        throw_error("'in <string>' requires string as left operand, not ", item.type_name());
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Type::kList:
      for (const Value& v : container.as_list())
        if (values_equal(v, item)) return true;
      return false;
    case Type::kDict:
      return item.is_string() && container.as_dict().find(item.as_string()) != nullptr;
    default:
      throw_error("argument of type '", container.type_name(), "' is not iterable");
  }
}

// Python slice index normalisation (PySlice_AdjustIndices).
ValueList slice_indices(int64_t len, const Value& start_v, const Value& stop_v, const Value& step_v,
                        std::vector<int64_t>* idx) {
  auto as_opt = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_none() || v.is_undefined()) return std::nullopt;
    return int_arg(v, what);
  };
  int64_t step = as_opt(step_v, "slice step").value_or(1);
  if (step == 0) throw_error("slice step cannot be zero");
  auto start_o = as_opt(start_v, "slice start"), stop_o = as_opt(stop_v, "slice stop");
  int64_t start, stop;
  auto adjust = [&](int64_t x, bool is_start) {
    (void)is_start;
    if (x < 0) {
      x += len;
      if (x < 0) x = step < 0 ? -1 : 0;
    } else if (x >= len) {
      x = step < 0 ? len - 1 : len;
    }
    return x;
  };
  start = start_o ? adjust(*start_o, true) : (step < 0 ? len - 1 : 0);
  stop = stop_o ? adjust(*stop_o, false) : (step < 0 ? -1 : len);
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) idx->push_back(i);
  return {};
}

bool is_str_method(const std::string& n) {
  static const std::unordered_set<std::string> k = {
      "startswith",   "endswith",    "split",     "rsplit",       "splitlines",   "strip",
      "lstrip",       "rstrip",      "replace",   "upper",        "lower",        "title",
      "capitalize",   "find",        "rfind",     "index",        "rindex",       "count",
      "join",         "isdigit",     "isalpha",   "isalnum",      "isspace",      "isupper",
      "islower",      "isnumeric",   "isdecimal", "removeprefix", "removesuffix", "center",
      "ljust",        "rjust",       "zfill",     "swapcase",     "partition",    "rpartition",
      "format",       "casefold",    "encode",    "expandtabs",   "format_map",   "isascii",
      "isidentifier", "isprintable", "istitle",   "maketrans",    "translate"};
  return k.count(n) > 0;
}

// ---------------------------------------------------------------------------------------------

class Renderer {
 public:
  Renderer(const TemplateProgram& prog, const Dict& vars) : prog_(prog) {
    globals_ = std::make_shared<Scope>(nullptr);
    add_globals();
    root_ = std::make_shared<Scope>(globals_);
    root_->vars.reserve(vars.items.size());
    for (const auto& kv : vars.items) root_->vars.push_back(kv);
  }

  std::string run() {
    std::string out;
    try {
      exec_body(prog_.body, root_, out);
    } catch (const TemplateError&) {
      throw;
    } catch (const Error& e) {  // from a helper outside any expression (e.g. loop unpacking)
      throw TemplateError(e.what(), line_, col_, false);
    }
    return out;
  }

  [[noreturn]] void fail(const std::string& msg) const {
    throw TemplateError(msg, line_, col_, false);
  }
  [[noreturn]] void fail_undefined(const Value& v) const {
    fail(v.as_string().empty() ? "undefined value used" : v.as_string());
  }

  // --- attribute and item access (jinja2 sandbox getattr / getitem) ---------------------------

  Value get_attr(const Value& obj, const std::string& name) {
    switch (obj.type()) {
      case Type::kUndefined:
        fail_undefined(obj);
      case Type::kDict: {
        if (name == "items" || name == "keys" || name == "values" || name == "get" ||
            name == "copy")
          return bound_method(obj, name);
        if (name == "clear" || name == "pop" || name == "popitem" || name == "setdefault" ||
            name == "update")
          return Value::undefined("access to attribute '" + name + "' of 'dict' object is unsafe");
        if (const Value* v = obj.as_dict().find(name)) return *v;
        break;
      }
      case Type::kString:
        if (is_str_method(name)) return bound_method(obj, name);
        break;
      case Type::kList:
        if (name == "index" || name == "count" || name == "copy") return bound_method(obj, name);
        if (name == "append" || name == "extend" || name == "insert" || name == "pop" ||
            name == "remove" || name == "reverse" || name == "sort" || name == "clear")
          return Value::undefined("access to attribute '" + name + "' of 'list' object is unsafe");
        break;
      case Type::kNamespace:
        if (const Value* v = obj.as_namespace().attrs.find(name)) return *v;
        break;
      default:
        break;
    }
    return Value::undefined("'" + obj.type_name() + "' has no attribute '" + name + "'");
  }

  Value get_item(const Value& obj, const Value& key) {
    if (obj.is_undefined()) fail_undefined(obj);
    if (obj.is_dict()) {
      if (key.is_string()) {
        if (const Value* v = obj.as_dict().find(key.as_string())) return *v;
        Value attr = get_attr(obj, key.as_string());
        if (!attr.is_undefined()) return attr;
        return Value::undefined("'dict object' has no attribute '" + key.as_string() + "'");
      }
      return Value::undefined("'dict object' has no attribute " + key.repr());
    }
    if ((obj.is_list() || obj.is_string()) && (key.is_int() || key.is_bool())) {
      int64_t i = key.as_int();
      if (obj.is_list()) {
        int64_t n = static_cast<int64_t>(obj.as_list().size());
        if (i < 0) i += n;
        if (i < 0 || i >= n)
          return Value::undefined(obj.type_name() + " has no element " +
                                  std::to_string(key.as_int()));
        return obj.as_list()[static_cast<size_t>(i)];
      }
      std::vector<uint32_t> cps = utf8_decode(obj.as_string());
      int64_t n = static_cast<int64_t>(cps.size());
      if (i < 0) i += n;
      if (i < 0 || i >= n)
        return Value::undefined("str object has no element " + std::to_string(key.as_int()));
      return Value::string(from_cps(cps, static_cast<size_t>(i), static_cast<size_t>(i) + 1));
    }
    if (key.is_string()) return get_attr(obj, key.as_string());
    return Value::undefined("'" + obj.type_name() + "' has no element " + key.repr());
  }

  Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
    if (obj.is_undefined()) fail_undefined(obj);
    std::vector<int64_t> idx;
    if (obj.is_list()) {
      const ValueList& l = obj.as_list();
      slice_indices(static_cast<int64_t>(l.size()), start, stop, step, &idx);
      ValueList out;
      out.reserve(idx.size());
      for (int64_t i : idx) out.push_back(l[static_cast<size_t>(i)]);
      return Value::list(std::move(out), obj.is_tuple());
    }
    if (obj.is_string()) {
      std::vector<uint32_t> cps = utf8_decode(obj.as_string());
      slice_indices(static_cast<int64_t>(cps.size()), start, stop, step, &idx);
      std::string out;
      for (int64_t i : idx) utf8_append(out, cps[static_cast<size_t>(i)]);
      return Value::string(std::move(out));
    }
    return Value::undefined("'" + obj.type_name() + "' cannot be sliced");
  }

  // Jinja's attribute getter for filters (`attribute='a.b.0'`).
  Value get_path(const Value& obj, const std::string& path) {
    Value cur = obj;
    for (const std::string& part : py_split(path, ".", -1)) {
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(),
                                                 [](char c) { return c >= '0' && c <= '9'; });
      cur = get_item(cur, digits ? Value::integer(std::stoll(part)) : Value::string(part));
    }
    return cur;
  }

  Value call(const Value& fn, CallArgs& args) {
    if (fn.is_function()) return fn.as_function().call(args);
    if (fn.is_undefined()) fail_undefined(fn);
    fail("'" + fn.type_name() + "' is not callable");
  }

  Value apply_filter(const std::string& name, const Value& input, CallArgs& args) {
    return filters().at(name)(*this, input, args);
  }
  bool apply_test(const std::string& name, const Value& input, CallArgs& args) {
    auto it = tests().find(name);
    if (it == tests().end()) fail("no test named '" + name + "'");
    return it->second(*this, input, args);
  }

 private:
  // --- methods ------------------------------------------------------------------------------

  Value bound_method(const Value& obj, const std::string& name) {
    return Value::function(name,
                           [this, obj, name](CallArgs& a) { return call_method(obj, name, a); });
  }

  Value call_method(const Value& obj, const std::string& name, CallArgs& a) {
    if (obj.is_dict()) {
      const Dict& d = obj.as_dict();
      if (name == "get") {
        Args p("get", a, {"key", "default"});
        if (p[0].is_string())
          if (const Value* v = d.find(p[0].as_string())) return *v;
        return p.has(1) ? p[1] : Value::none();
      }
      Args p(name.c_str(), a, {});
      ValueList out;
      if (name == "copy") return obj;
      for (const auto& [k, v] : d.items) {
        if (name == "items")
          out.push_back(Value::list({Value::string(k), v}, true));
        else if (name == "keys")
          out.push_back(Value::string(k));
        else
          out.push_back(v);
      }
      return Value::list(std::move(out));
    }
    if (obj.is_list()) {
      const ValueList& l = obj.as_list();
      if (name == "copy") {
        Args p("copy", a, {});
        return obj;
      }
      Args p(name.c_str(), a, {"value"});
      int64_t count = 0;
      for (size_t i = 0; i < l.size(); ++i) {
        if (values_equal(l[i], p[0])) {
          if (name == "index") return Value::integer(static_cast<int64_t>(i));
          ++count;
        }
      }
      if (name == "index") fail(p[0].repr() + " is not in list");
      return Value::integer(count);
    }
    return call_str_method(obj.as_string(), name, a);
  }

  Value call_str_method(const std::string& s, const std::string& name, CallArgs& a) {
    auto str_list = [](std::vector<std::string> parts) {
      ValueList out;
      out.reserve(parts.size());
      for (auto& p : parts) out.push_back(Value::string(std::move(p)));
      return Value::list(std::move(out));
    };
    if (name == "startswith" || name == "endswith") {
      Args p(name.c_str(), a, {"prefix"});
      bool ends = name == "endswith";
      auto test = [&](const Value& x) {
        const std::string& t = str_arg(x, name.c_str());
        if (t.size() > s.size()) return false;
        return ends ? s.compare(s.size() - t.size(), t.size(), t) == 0
                    : s.compare(0, t.size(), t) == 0;
      };
      if (p[0].is_tuple()) {
        for (const Value& x : p[0].as_list())
          if (test(x)) return Value::boolean(true);
        return Value::boolean(false);
      }
      return Value::boolean(test(p[0]));
    }
    if (name == "split" || name == "rsplit") {
      Args p(name.c_str(), a, {"sep", "maxsplit"});
      int64_t maxsplit = p.has(1) ? int_arg(p[1], "maxsplit") : -1;
      bool r = name == "rsplit";
      if (!p.present(0)) return str_list(r ? py_rsplit_ws(s, maxsplit) : py_split_ws(s, maxsplit));
      const std::string& sep = str_arg(p[0], "sep");
      if (sep.empty()) fail("empty separator");
      return str_list(r ? py_rsplit(s, sep, maxsplit) : py_split(s, sep, maxsplit));
    }
    if (name == "splitlines") {
      Args p(name.c_str(), a, {"keepends"});
      return str_list(py_splitlines(s, p[0].truthy()));
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      Args p(name.c_str(), a, {"chars"});
      if (p.present(0)) str_arg(p[0], "chars");
      return Value::string(py_strip(s, p[0], name != "rstrip", name != "lstrip"));
    }
    if (name == "replace") {
      Args p("replace", a, {"old", "new", "count"});
      return Value::string(py_replace(s, str_arg(p[0], "old"), str_arg(p[1], "new"),
                                      p.has(2) ? int_arg(p[2], "count") : -1));
    }
    if (name == "upper" || name == "lower" || name == "casefold") {
      Args p(name.c_str(), a, {});
      return Value::string(map_case(s, name == "upper"));
    }
    if (name == "title") {
      Args p(name.c_str(), a, {});
      return Value::string(py_title(s));
    }
    if (name == "capitalize") {
      Args p(name.c_str(), a, {});
      return Value::string(py_capitalize(s));
    }
    if (name == "swapcase") {
      Args p(name.c_str(), a, {});
      std::string out;
      for (uint32_t c : utf8_decode(s)) {
        auto cp = static_cast<utf8proc_int32_t>(c);
        utf8_append(out, static_cast<uint32_t>(utf8proc_isupper(cp) ? utf8proc_tolower(cp)
                                                                    : utf8proc_toupper(cp)));
      }
      return Value::string(out);
    }
    if (name == "find" || name == "rfind" || name == "index" || name == "rindex" ||
        name == "count") {
      Args p(name.c_str(), a, {"sub"});
      const std::string& sub = str_arg(p[0], "sub");
      if (name == "count") {
        if (sub.empty()) return Value::integer(static_cast<int64_t>(utf8_length(s)) + 1);
        int64_t n = 0;
        for (size_t q = s.find(sub); q != std::string::npos; q = s.find(sub, q + sub.size())) ++n;
        return Value::integer(n);
      }
      size_t q = (name[0] == 'r') ? s.rfind(sub) : s.find(sub);
      if (q == std::string::npos) {
        if (name == "index" || name == "rindex") fail("substring not found");
        return Value::integer(-1);
      }
      return Value::integer(static_cast<int64_t>(utf8_length(std::string_view(s).substr(0, q))));
    }
    if (name == "join") {
      Args p("join", a, {"iterable"});
      std::string out;
      bool first = true;
      for (const Value& v : iterate(p[0])) {
        if (!v.is_string())
          fail("sequence item: expected str instance, " + v.type_name() + " found");
        if (!first) out += s;
        first = false;
        out += v.as_string();
      }
      return Value::string(out);
    }
    if (name == "removeprefix" || name == "removesuffix") {
      Args p(name.c_str(), a, {"affix"});
      const std::string& t = str_arg(p[0], "affix");
      if (name == "removeprefix" && s.compare(0, t.size(), t) == 0)
        return Value::string(s.substr(t.size()));
      if (name == "removesuffix" && !t.empty() && t.size() <= s.size() &&
          s.compare(s.size() - t.size(), t.size(), t) == 0)
        return Value::string(s.substr(0, s.size() - t.size()));
      return Value::string(s);
    }
    if (name == "center" || name == "ljust" || name == "rjust" || name == "zfill") {
      Args p(name.c_str(), a, {"width", "fillchar"});
      int64_t width = int_arg(p[0], "width");
      std::string fill = p.has(1) ? str_arg(p[1], "fillchar") : (name == "zfill" ? "0" : " ");
      if (utf8_length(fill) != 1) fail("The fill character must be exactly one character long");
      int64_t len = static_cast<int64_t>(utf8_length(s));
      if (width <= len) return Value::string(s);
      int64_t pad = width - len, left = 0;
      if (name == "center")
        left = pad / 2 + (pad & width & 1);
      else if (name == "rjust")
        left = pad;
      else if (name == "zfill") {
        std::string body = s, sign;
        if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
          sign = body.substr(0, 1);
          body = body.substr(1);
        }
        std::string out = sign;
        for (int64_t i = 0; i < pad; ++i) out += '0';
        return Value::string(out + body);
      }
      std::string out;
      for (int64_t i = 0; i < left; ++i) out += fill;
      out += s;
      for (int64_t i = 0; i < pad - left; ++i) out += fill;
      return Value::string(out);
    }
    if (name == "partition" || name == "rpartition") {
      Args p(name.c_str(), a, {"sep"});
      const std::string& sep = str_arg(p[0], "sep");
      if (sep.empty()) fail("empty separator");
      size_t q = name == "partition" ? s.find(sep) : s.rfind(sep);
      if (q == std::string::npos)
        return name == "partition"
                   ? Value::list({Value::string(s), Value::string(""), Value::string("")}, true)
                   : Value::list({Value::string(""), Value::string(""), Value::string(s)}, true);
      return Value::list({Value::string(s.substr(0, q)), Value::string(sep),
                          Value::string(s.substr(q + sep.size()))},
                         true);
    }
    if (name.rfind("is", 0) == 0 && name != "isidentifier" && name != "isprintable" &&
        name != "istitle") {
      Args p(name.c_str(), a, {});
      std::vector<uint32_t> cps = utf8_decode(s);
      if (name == "isupper" || name == "islower") {
        bool any_cased = false;
        for (uint32_t c : cps) {
          auto cp = static_cast<utf8proc_int32_t>(c);
          if (name == "isupper" ? utf8proc_islower(cp) : utf8proc_isupper(cp))
            return Value::boolean(false);
          if (is_cased_letter(c)) any_cased = true;
        }
        return Value::boolean(any_cased);
      }
      if (cps.empty()) return Value::boolean(name == "isascii");
      for (uint32_t c : cps) {
        bool ok = name == "isdigit" || name == "isdecimal" ? is_decimal(c)
                  : name == "isnumeric"                    ? is_numeric(c)
                  : name == "isalpha"                      ? is_alpha(c)
                  : name == "isalnum"                      ? (is_alpha(c) || is_numeric(c))
                  : name == "isspace"                      ? is_python_space(c)
                                                           : c < 0x80;  // isascii
        if (!ok) return Value::boolean(false);
      }
      return Value::boolean(true);
    }
    fail("str." + name + "() is not supported by the chat-template interpreter");
  }

  // --- globals -------------------------------------------------------------------------------

  void add_globals() {
    globals_->set(
        "range", Value::function("range", [this](CallArgs& a) {
          if (!a.kwargs.empty()) fail("range() takes no keyword arguments");
          if (a.args.empty() || a.args.size() > 3) fail("range expected 1 to 3 arguments");
          int64_t start = 0, stop, step = 1;
          if (a.args.size() == 1) {
            stop = int_arg(a.args[0], "range() argument");
          } else {
            start = int_arg(a.args[0], "range() argument");
            stop = int_arg(a.args[1], "range() argument");
            if (a.args.size() == 3) step = int_arg(a.args[2], "range() argument");
          }
          if (step == 0) fail("range() arg 3 must not be zero");
          ValueList out;
          for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            if (static_cast<int64_t>(out.size()) >= kMaxRange)
              fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
            out.push_back(Value::integer(i));
          }
          return Value::list(std::move(out));
        }));
    auto make_dict = [this](CallArgs& a, bool ns) {
      Dict d;
      if (a.args.size() > 1)
        fail(std::string(ns ? "namespace" : "dict") + "() takes at most 1 positional argument");
      if (a.args.size() == 1) {
        const Value& src = a.args[0];
        if (src.is_dict()) {
          d = src.as_dict();
        } else if (src.is_list()) {
          for (const Value& kv : src.as_list()) {
            if (!kv.is_list() || kv.as_list().size() != 2 || !kv.as_list()[0].is_string())
              fail("dict() sequence elements must be (string key, value) pairs");
            d.set(kv.as_list()[0].as_string(), kv.as_list()[1]);
          }
        } else if (!src.is_undefined()) {
          fail("'" + src.type_name() + "' is not a mapping");
        }
      }
      for (auto& [k, v] : a.kwargs) d.set(k, v);
      if (ns)
        for (auto& kv : d.items)
          if (!kv.first.empty() && kv.first[0] == '_')
            fail(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, but "
                "got '" +
                kv.first + "'. Please rename the attribute.");
      return d;
    };
    globals_->set("namespace", Value::function("namespace", [make_dict](CallArgs& a) {
                    return Value::make_namespace(make_dict(a, true));
                  }));
    globals_->set("dict", Value::function("dict", [make_dict](CallArgs& a) {
                    return Value::dict(make_dict(a, false));
                  }));
    globals_->set("raise_exception",
                  Value::function("raise_exception", [this](CallArgs& a) -> Value {
                    Args p("raise_exception", a, {"message"});
                    throw TemplateError(p[0].str(), line_, col_, true);
                  }));
    globals_->set("strftime_now", Value::function("strftime_now", [](CallArgs& a) {
                    Args p("strftime_now", a, {"format"});
                    const std::string& fmt = str_arg(p[0], "format");
                    std::time_t t = std::time(nullptr);
                    std::tm tm{};
                    localtime_r(&t, &tm);
                    std::vector<char> buf(fmt.size() * 8 + 64);
                    size_t n = std::strftime(buf.data(), buf.size(), fmt.c_str(), &tm);
                    return Value::string(std::string(buf.data(), n));
                  }));
  }

  // --- statements ----------------------------------------------------------------------------

  Flow exec_body(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const auto& s : body) {
      Flow f = exec(*s, scope, out);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

  void assign(const Stmt& s, const ScopePtr& scope, Value v) {
    if (!s.ns_attr.empty()) {
      const Value* target = scope->find(s.targets[0]);
      if (!target || !target->is_namespace())
        fail("Cannot assign attribute on non-namespace object");
      if (s.ns_attr[0] == '_')
        fail(
            "Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" +
            s.ns_attr + "'. Please rename the attribute.");
      target->as_namespace().attrs.set(s.ns_attr, std::move(v));
      return;
    }
    bind_targets(s.targets, scope, v);
  }

  void bind_targets(const std::vector<std::string>& targets, const ScopePtr& scope,
                    const Value& v) {
    if (targets.size() == 1) {
      scope->set(targets[0], v);
      return;
    }
    ValueList items = iterate(v);
    if (items.size() != targets.size())
      fail((items.size() < targets.size() ? "not enough" : "too many") +
           std::string(" values to unpack (expected ") + std::to_string(targets.size()) + ", got " +
           std::to_string(items.size()) + ")");
    for (size_t i = 0; i < targets.size(); ++i) scope->set(targets[i], items[i]);
  }

  Value apply_block_filters(const Expr& chain, std::string text, const ScopePtr& scope) {
    Value saved = block_input_;
    block_input_ = Value::string(std::move(text));
    Value v = eval(chain, scope);
    block_input_ = saved;
    return v;
  }

  Flow exec(const Stmt& s, const ScopePtr& scope, std::string& out) {
    line_ = s.line;
    col_ = s.col;
    switch (s.kind) {
      case StmtKind::kText:
        out += s.text;
        return Flow::kNormal;
      case StmtKind::kOutput: {
        Value v = eval(*s.exprs[0], scope);
        if (v.is_string())
          out += v.as_string();
        else
          out += v.str();
        return Flow::kNormal;
      }
      case StmtKind::kIf:
        for (size_t i = 0; i < s.exprs.size(); ++i)
          if (eval(*s.exprs[i], scope).truthy()) return exec_body(s.bodies[i], scope, out);
        if (s.bodies.size() > s.exprs.size()) return exec_body(s.bodies.back(), scope, out);
        return Flow::kNormal;
      case StmtKind::kFor:
        exec_for(s, scope, out);
        return Flow::kNormal;
      case StmtKind::kSet:
        assign(s, scope, eval(*s.exprs[0], scope));
        return Flow::kNormal;
      case StmtKind::kSetBlock: {
        std::string text;
        exec_body(s.bodies[0], std::make_shared<Scope>(scope), text);
        Value v = s.exprs.empty() ? Value::string(std::move(text))
                                  : apply_block_filters(*s.exprs[0], std::move(text), scope);
        assign(s, scope, std::move(v));
        return Flow::kNormal;
      }
      case StmtKind::kMacro: {
        const Stmt* m = &s;
        std::weak_ptr<Scope> def_scope =
            scope;  // the scope holds the macro: avoid a reference cycle
        scope->set(s.name, Value::function(s.name, [this, m, def_scope](CallArgs& a) {
                     ScopePtr d = def_scope.lock();
                     if (!d) fail("macro '" + m->name + "' called after its scope ended");
                     return call_macro(*m, d, a);
                   }));
        return Flow::kNormal;
      }
      case StmtKind::kBreak:
        return Flow::kBreak;
      case StmtKind::kContinue:
        return Flow::kContinue;
      case StmtKind::kFilterBlock: {
        std::string text;
        exec_body(s.bodies[0], std::make_shared<Scope>(scope), text);
        out += apply_block_filters(*s.exprs[0], std::move(text), scope).str();
        return Flow::kNormal;
      }
      case StmtKind::kWith: {
        auto inner = std::make_shared<Scope>(scope);
        for (size_t i = 0; i < s.targets.size(); ++i)
          inner->set(s.targets[i], eval(*s.exprs[i], scope));
        return exec_body(s.bodies[0], inner, out);
      }
      case StmtKind::kScope:
        return exec_body(s.bodies[0], std::make_shared<Scope>(scope), out);
    }
    return Flow::kNormal;
  }

  void exec_for(const Stmt& s, const ScopePtr& scope, std::string& out) {
    Value iterable = eval(*s.exprs[0], scope);
    if (!(iterable.is_list() || iterable.is_dict() || iterable.is_string() ||
          iterable.is_undefined()))
      fail("'" + iterable.type_name() + "' is not iterable");
    ValueList items = iterate(iterable);
    if (s.exprs.size() > 1) {  // loop filter: `for x in xs if cond`
      ValueList kept;
      for (const Value& item : items) {
        count_loop_step();
        auto fs = std::make_shared<Scope>(scope);
        bind_targets(s.targets, fs, item);
        if (eval(*s.exprs[1], fs).truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    size_t n = items.size();
    for (size_t i = 0; i < n; ++i) {
      count_loop_step();
      auto it = std::make_shared<Scope>(scope);
      bind_targets(s.targets, it, items[i]);
      Dict loop;
      loop.items.reserve(12);
      auto i64 = static_cast<int64_t>(i), n64 = static_cast<int64_t>(n);
      loop.items.emplace_back("index", Value::integer(i64 + 1));
      loop.items.emplace_back("index0", Value::integer(i64));
      loop.items.emplace_back("revindex", Value::integer(n64 - i64));
      loop.items.emplace_back("revindex0", Value::integer(n64 - i64 - 1));
      loop.items.emplace_back("first", Value::boolean(i == 0));
      loop.items.emplace_back("last", Value::boolean(i + 1 == n));
      loop.items.emplace_back("length", Value::integer(n64));
      loop.items.emplace_back("depth", Value::integer(1));
      loop.items.emplace_back("depth0", Value::integer(0));
      loop.items.emplace_back("previtem",
                              i > 0 ? items[i - 1] : Value::undefined("there is no previous item"));
      loop.items.emplace_back("nextitem",
                              i + 1 < n ? items[i + 1] : Value::undefined("there is no next item"));
      loop.items.emplace_back("cycle", Value::function("cycle", [this, i](CallArgs& a) {
                                if (a.args.empty()) fail("no items for cycling given");
                                return a.args[i % a.args.size()];
                              }));
      it->set("loop", Value::dict(std::move(loop)));
      Flow f = exec_body(s.bodies[0], it, out);
      if (f == Flow::kBreak) break;
    }
    if (n == 0 && s.bodies.size() > 1) exec_body(s.bodies[1], std::make_shared<Scope>(scope), out);
  }

  void count_loop_step() {
    if (++loop_steps_ > kMaxLoopSteps)
      fail("the template ran more than " + std::to_string(kMaxLoopSteps) + " loop iterations");
  }

  Value call_macro(const Stmt& m, const ScopePtr& def_scope, CallArgs& a) {
    struct DepthGuard {
      int& d;
      ~DepthGuard() { --d; }
    } guard{++depth_};
    if (depth_ > kMaxCallDepth)
      fail("maximum macro recursion depth (" + std::to_string(kMaxCallDepth) + ") exceeded");
    int saved_line = line_, saved_col = col_;
    auto scope = std::make_shared<Scope>(def_scope);
    size_t np = m.targets.size();
    std::vector<bool> given(np, false);
    ValueList varargs;
    for (size_t i = 0; i < a.args.size(); ++i) {
      if (i < np) {
        scope->set(m.targets[i], a.args[i]);
        given[i] = true;
      } else if (m.uses_varargs) {
        varargs.push_back(a.args[i]);
      } else {
        fail("macro '" + m.name + "' takes not more than " + std::to_string(np) + " argument(s)");
      }
    }
    Dict kwargs;
    for (auto& [k, v] : a.kwargs) {
      auto p = std::find(m.targets.begin(), m.targets.end(), k);
      if (p != m.targets.end()) {
        size_t i = static_cast<size_t>(p - m.targets.begin());
        if (given[i]) fail("macro '" + m.name + "' got multiple values for argument '" + k + "'");
        scope->set(k, v);
        given[i] = true;
      } else if (m.uses_kwargs) {
        kwargs.set(k, v);
      } else {
        fail("macro '" + m.name + "' takes no keyword argument '" + k + "'");
      }
    }
    for (size_t i = 0; i < np; ++i) {
      if (given[i]) continue;
      if (m.exprs[i])
        scope->set(m.targets[i], eval(*m.exprs[i], scope));
      else
        scope->set(m.targets[i],
                   Value::undefined("parameter '" + m.targets[i] + "' was not provided"));
    }
    if (m.uses_varargs) scope->set("varargs", Value::list(std::move(varargs), true));
    if (m.uses_kwargs) scope->set("kwargs", Value::dict(std::move(kwargs)));
    std::string out;
    exec_body(m.bodies[0], scope, out);
    line_ = saved_line;
    col_ = saved_col;
    return Value::string(std::move(out));
  }

  // --- expressions ---------------------------------------------------------------------------

  void collect_args(const Expr& e, const ScopePtr& scope, CallArgs& args) {
    args.args.reserve(e.n_pos);
    for (size_t i = 0; i < e.n_pos; ++i) args.args.push_back(eval(*e.kids[1 + i], scope));
    for (size_t i = 0; i < e.kw_names.size(); ++i)
      args.kwargs.emplace_back(e.kw_names[i], eval(*e.kids[1 + e.n_pos + i], scope));
  }

  Value binary_op(const std::string& op, const Value& a, const Value& b) {
    if (a.is_undefined()) fail_undefined(a);
    if (b.is_undefined()) fail_undefined(b);
    bool nums = a.is_number() && b.is_number();
    bool ints = nums && !a.is_float() && !b.is_float();
    if (op == "+") {
      if (ints) return Value::integer(add_i(a.as_int(), b.as_int()));
      if (nums) return Value::floating(a.as_float() + b.as_float());
      if (a.is_string() && b.is_string()) return Value::string(a.as_string() + b.as_string());
      if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple()) {
        ValueList l = a.as_list();
        l.insert(l.end(), b.as_list().begin(), b.as_list().end());
        return Value::list(std::move(l), a.is_tuple());
      }
    } else if (op == "-") {
      if (ints) return Value::integer(sub_i(a.as_int(), b.as_int()));
      if (nums) return Value::floating(a.as_float() - b.as_float());
    } else if (op == "*") {
      if (ints) return Value::integer(mul_i(a.as_int(), b.as_int()));
      if (nums) return Value::floating(a.as_float() * b.as_float());
      const Value* seq = (a.is_string() || a.is_list())   ? &a
                         : (b.is_string() || b.is_list()) ? &b
                                                          : nullptr;
      const Value* cnt = seq == &a ? &b : &a;
      if (seq && (cnt->is_int() || cnt->is_bool())) {
        int64_t n = std::max<int64_t>(0, cnt->as_int());
        if (n * (seq->is_string() ? static_cast<int64_t>(seq->as_string().size())
                                  : static_cast<int64_t>(seq->as_list().size())) >
            (1 << 26))
          fail("sequence repetition result is too large");
        if (seq->is_string()) {
          std::string out;
          for (int64_t i = 0; i < n; ++i) out += seq->as_string();
          return Value::string(out);
        }
        ValueList out;
        for (int64_t i = 0; i < n; ++i)
          out.insert(out.end(), seq->as_list().begin(), seq->as_list().end());
        return Value::list(std::move(out), seq->is_tuple());
      }
    } else if (op == "/") {
      if (nums) {
        if (b.as_float() == 0) fail("division by zero");
        return Value::floating(a.as_float() / b.as_float());
      }
    } else if (op == "//") {
      if (nums) {
        if (b.as_float() == 0) fail("integer division or modulo by zero");
        if (ints) {
          int64_t x = a.as_int(), y = b.as_int(), q = x / y;
          if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
          return Value::integer(q);
        }
        return Value::floating(std::floor(a.as_float() / b.as_float()));
      }
    } else if (op == "%") {
      if (nums) {
        if (b.as_float() == 0) fail("integer division or modulo by zero");
        if (ints) {
          int64_t x = a.as_int(), y = b.as_int(), m = x % y;
          if (m != 0 && ((m < 0) != (y < 0))) m += y;
          return Value::integer(m);
        }
        return Value::floating(py_fmod(a.as_float(), b.as_float()));
      }
      if (a.is_string()) fail("printf-style string formatting ('%' on strings) is not supported");
    } else if (op == "**") {
      if (ints && b.as_int() >= 0) {
        int64_t base = a.as_int(), res = 1;
        for (int64_t i = 0; i < b.as_int(); ++i) res = mul_i(res, base);
        return Value::integer(res);
      }
      if (nums) return Value::floating(std::pow(a.as_float(), b.as_float()));
    }
    fail("unsupported operand type(s) for " + op + ": '" + a.type_name() + "' and '" +
         b.type_name() + "'");
  }

  bool compare_op(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return values_equal(a, b);
    if (op == "!=") return !values_equal(a, b);
    if (op == "in") return contains(b, a);
    if (op == "notin") return !contains(b, a);
    if (a.is_undefined()) fail_undefined(a);
    if (b.is_undefined()) fail_undefined(b);
    int c = compare_values(a, b);
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;
  }

 public:
  Value eval(const Expr& e, const ScopePtr& scope) {
    try {
      return eval_inner(e, scope);
    } catch (const TemplateError&) {
      throw;
    } catch (const Error& err) {
      throw TemplateError(err.what(), e.line, e.col, false);
    }
  }

 private:
  Value eval_inner(const Expr& e, const ScopePtr& scope) {
    line_ = e.line;
    col_ = e.col;
    switch (e.kind) {
      case ExprKind::kConst:
        return e.value;
      case ExprKind::kName: {
        if (const Value* v = scope->find(e.name)) return *v;
        return Value::undefined("'" + e.name + "' is undefined");
      }
      case ExprKind::kBlockInput:
        return block_input_;
      case ExprKind::kGetattr: {
        Value obj = eval(*e.kids[0], scope);
        line_ = e.line;
        col_ = e.col;
        return get_attr(obj, e.name);
      }
      case ExprKind::kGetitem: {
        Value obj = eval(*e.kids[0], scope);
        Value key = eval(*e.kids[1], scope);
        line_ = e.line;
        col_ = e.col;
        return get_item(obj, key);
      }
      case ExprKind::kSlice: {
        Value obj = eval(*e.kids[0], scope);
        Value parts[3];
        for (int i = 0; i < 3; ++i)
          parts[i] = e.kids[1 + i] ? eval(*e.kids[1 + i], scope) : Value::none();
        line_ = e.line;
        col_ = e.col;
        return slice(obj, parts[0], parts[1], parts[2]);
      }
      case ExprKind::kCall: {
        Value fn = eval(*e.kids[0], scope);
        CallArgs args;
        collect_args(e, scope, args);
        line_ = e.line;
        col_ = e.col;
        return call(fn, args);
      }
      case ExprKind::kFilter: {
        Value input = eval(*e.kids[0], scope);
        CallArgs args;
        collect_args(e, scope, args);
        line_ = e.line;
        col_ = e.col;
        return apply_filter(e.name, input, args);
      }
      case ExprKind::kTest: {
        Value input = eval(*e.kids[0], scope);
        CallArgs args;
        collect_args(e, scope, args);
        line_ = e.line;
        col_ = e.col;
        return Value::boolean(apply_test(e.name, input, args));
      }
      case ExprKind::kNeg:
      case ExprKind::kPos: {
        Value v = eval(*e.kids[0], scope);
        line_ = e.line;
        col_ = e.col;
        if (v.is_undefined()) fail_undefined(v);
        if (v.is_float())
          return Value::floating(e.kind == ExprKind::kNeg ? -v.as_float() : v.as_float());
        if (v.is_number()) {
          if (e.kind == ExprKind::kPos) return Value::integer(v.as_int());
          return Value::integer(sub_i(int64_t{0}, v.as_int()));
        }
        fail(std::string("bad operand type for unary ") + (e.kind == ExprKind::kNeg ? "-" : "+") +
             ": '" + v.type_name() + "'");
      }
      case ExprKind::kNot:
        return Value::boolean(!eval(*e.kids[0], scope).truthy());
      case ExprKind::kAnd: {
        Value a = eval(*e.kids[0], scope);
        return a.truthy() ? eval(*e.kids[1], scope) : a;
      }
      case ExprKind::kOr: {
        Value a = eval(*e.kids[0], scope);
        return a.truthy() ? a : eval(*e.kids[1], scope);
      }
      case ExprKind::kBinary: {
        Value a = eval(*e.kids[0], scope);
        Value b = eval(*e.kids[1], scope);
        line_ = e.line;
        col_ = e.col;
        return binary_op(e.name, a, b);
      }
      case ExprKind::kConcat: {
        std::string out;
        for (const auto& k : e.kids) out += eval(*k, scope).str();
        return Value::string(std::move(out));
      }
      case ExprKind::kCompare: {
        Value left = eval(*e.kids[0], scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.kids[i + 1], scope);
          line_ = e.line;
          col_ = e.col;
          if (!compare_op(e.ops[i], left, right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case ExprKind::kCond: {
        if (eval(*e.kids[0], scope).truthy()) return eval(*e.kids[1], scope);
        if (e.kids[2]) return eval(*e.kids[2], scope);
        return Value::undefined("the inline if-expression on line " + std::to_string(e.line) +
                                " evaluated to false and no else section was defined.");
      }
      case ExprKind::kList:
      case ExprKind::kTuple: {
        ValueList items;
        items.reserve(e.kids.size());
        for (const auto& k : e.kids) items.push_back(eval(*k, scope));
        return Value::list(std::move(items), e.kind == ExprKind::kTuple);
      }
      case ExprKind::kDict: {
        Dict d;
        for (size_t i = 0; i + 1 < e.kids.size(); i += 2) {
          Value k = eval(*e.kids[i], scope);
          if (!k.is_string())
            fail("only string keys are supported in dict literals, got " + k.type_name());
          d.set(k.as_string(), eval(*e.kids[i + 1], scope));
        }
        return Value::dict(std::move(d));
      }
    }
    fail("internal error: unknown expression");
  }

  const TemplateProgram& prog_;
  ScopePtr globals_, root_;
  Value block_input_;
  int line_ = 0, col_ = 0;
  int depth_ = 0;
  int64_t loop_steps_ = 0;  // loop iterations of this render (kMaxLoopSteps)
};

// ---------------------------------------------------------------------------------------------
// Filters (jinja2.filters + transformers' tojson)

Value sort_key(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::string(map_case(v.as_string(), 0));
  return v;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string ascii_escape_json(const std::string& s) {  // ensure_ascii=True
  std::string out;
  for (uint32_t c : utf8_decode(s)) {
    char buf[16];
    if (c < 0x7F) {
      out += static_cast<char>(c);
    } else if (c < 0x10000) {
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      uint32_t v = c - 0x10000;
      std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
      out += buf;
    }
  }
  return out;
}

Value f_tojson(Renderer&, const Value& x, CallArgs& a) {
  Args p("tojson", a, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonOptions opt;
  if (p.present(1)) {
    opt.pretty = true;
    opt.item_sep = ",";
    if (p[1].is_string())
      opt.indent = p[1].as_string();
    else
      opt.indent =
          std::string(static_cast<size_t>(std::max<int64_t>(0, int_arg(p[1], "indent"))), ' ');
  }
  if (p.present(2)) {
    if (!p[2].is_list() || p[2].as_list().size() != 2 || !p[2].as_list()[0].is_string() ||
        !p[2].as_list()[1].is_string())
      throw_error("tojson: separators must be a pair of strings");
    opt.item_sep = p[2].as_list()[0].as_string();
    opt.key_sep = p[2].as_list()[1].as_string();
  }
  opt.sort_keys = p[3].truthy();
  std::string out = x.to_json(opt);
  if (p[0].truthy()) out = ascii_escape_json(out);
  return Value::string(std::move(out));
}

Value f_trim(Renderer&, const Value& x, CallArgs& a) {
  Args p("trim", a, {"chars"});
  if (p.present(0)) str_arg(p[0], "chars");
  return Value::string(py_strip(x.str(), p[0], true, true));
}

Value f_items(Renderer&, const Value& x, CallArgs& a) {
  Args p("items", a, {});
  if (x.is_undefined()) return Value::list({});
  if (!x.is_dict()) throw_error("Can only get item pairs from a mapping.");
  ValueList out;
  for (const auto& [k, v] : x.as_dict().items)
    out.push_back(Value::list({Value::string(k), v}, true));
  return Value::list(std::move(out));
}

Value f_length(Renderer&, const Value& x, CallArgs& a) {
  Args p("length", a, {});
  return Value::integer(py_len(x));
}

Value f_string(Renderer&, const Value& x, CallArgs& a) {
  Args p("string", a, {});
  return x.is_string() ? x : Value::string(x.str());
}

Value f_default(Renderer&, const Value& x, CallArgs& a) {
  Args p("default", a, {"default_value", "boolean"});
  if (x.is_undefined() || (p[1].truthy() && !x.truthy()))
    return p.has(0) ? p[0] : Value::string("");
  return x;
}

Value f_join(Renderer& r, const Value& x, CallArgs& a) {
  Args p("join", a, {"d", "attribute"});
  std::string sep = p.has(0) ? p[0].str() : "";
  std::string out;
  bool first = true;
  for (const Value& v : iterate(x)) {
    if (!first) out += sep;
    first = false;
    out += (p.present(1) ? r.get_path(v, p[1].str()) : v).str();
  }
  return Value::string(out);
}

Value f_lower(Renderer&, const Value& x, CallArgs& a) {
  Args p("lower", a, {});
  return Value::string(map_case(x.str(), 0));
}
Value f_upper(Renderer&, const Value& x, CallArgs& a) {
  Args p("upper", a, {});
  return Value::string(map_case(x.str(), 1));
}
Value f_capitalize(Renderer&, const Value& x, CallArgs& a) {
  Args p("capitalize", a, {});
  return Value::string(py_capitalize(x.str()));
}
Value f_title(Renderer&, const Value& x,
              CallArgs& a) {  // jinja2's do_title: words split at [-\s({\[<]+
  Args p("title", a, {});
  std::string out;
  bool word_start = true;
  for (uint32_t c : utf8_decode(x.str())) {
    bool sep = is_python_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    auto cp = static_cast<utf8proc_int32_t>(c);
    if (sep) {
      utf8_append(out, c);
      word_start = true;
    } else {
      utf8_append(out,
                  static_cast<uint32_t>(word_start ? utf8proc_toupper(cp) : utf8proc_tolower(cp)));
      word_start = false;
    }
  }
  return Value::string(out);
}

Value f_first(Renderer&, const Value& x, CallArgs& a) {
  Args p("first", a, {});
  ValueList items = iterate(x);
  if (items.empty()) return Value::undefined("No first item, sequence was empty.");
  return items.front();
}
Value f_last(Renderer&, const Value& x, CallArgs& a) {
  Args p("last", a, {});
  ValueList items = iterate(x);
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return items.back();
}
Value f_list(Renderer&, const Value& x, CallArgs& a) {
  Args p("list", a, {});
  return Value::list(iterate(x));
}
Value f_safe(Renderer&, const Value& x, CallArgs& a) {
  Args p("safe", a, {});
  return x.is_string() ? x : Value::string(x.str());
}
Value f_escape(Renderer&, const Value& x, CallArgs& a) {
  Args p("escape", a, {});
  return Value::string(html_escape(x.str()));
}
Value f_replace(Renderer&, const Value& x, CallArgs& a) {
  Args p("replace", a, {"old", "new", "count"});
  return Value::string(
      py_replace(x.str(), p[0].str(), p[1].str(), p.present(2) ? int_arg(p[2], "count") : -1));
}
Value f_reverse(Renderer&, const Value& x, CallArgs& a) {
  Args p("reverse", a, {});
  if (x.is_string()) {
    std::vector<uint32_t> cps = utf8_decode(x.as_string());
    std::reverse(cps.begin(), cps.end());
    return Value::string(from_cps(cps, 0, cps.size()));
  }
  ValueList items = iterate(x);
  std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}

Value f_sort(Renderer& r, const Value& x, CallArgs& a) {
  Args p("sort", a, {"reverse", "case_sensitive", "attribute"});
  ValueList items = iterate(x);
  bool cs = p[1].truthy(), rev = p[0].truthy();
  std::vector<std::pair<Value, Value>> keyed;
  for (auto& v : items)
    keyed.emplace_back(sort_key(p.present(2) ? r.get_path(v, p[2].str()) : v, cs), v);
  std::stable_sort(keyed.begin(), keyed.end(), [rev](const auto& l, const auto& rr) {
    return rev ? compare_values(rr.first, l.first) < 0 : compare_values(l.first, rr.first) < 0;
  });
  ValueList out;
  for (auto& kv : keyed) out.push_back(kv.second);
  return Value::list(std::move(out));
}

Value f_unique(Renderer& r, const Value& x, CallArgs& a) {
  Args p("unique", a, {"case_sensitive", "attribute"});
  ValueList out, seen;
  for (const Value& v : iterate(x)) {
    Value key = sort_key(p.present(1) ? r.get_path(v, p[1].str()) : v, p[0].truthy());
    bool dup = false;
    for (const Value& s : seen) dup = dup || values_equal(s, key);
    if (!dup) {
      seen.push_back(key);
      out.push_back(v);
    }
  }
  return Value::list(std::move(out));
}

Value f_dictsort(Renderer&, const Value& x, CallArgs& a) {
  Args p("dictsort", a, {"case_sensitive", "by", "reverse"});
  if (!x.is_dict()) throw_error("dictsort: value is not a mapping");
  std::string by = p.has(1) ? p[1].str() : "key";
  if (by != "key" && by != "value") throw_error("You can only sort by either \"key\" or \"value\"");
  ValueList pairs;
  for (const auto& [k, v] : x.as_dict().items)
    pairs.push_back(Value::list({Value::string(k), v}, true));
  bool cs = p[0].truthy(), rev = p[2].truthy();
  size_t idx = by == "key" ? 0 : 1;
  std::stable_sort(pairs.begin(), pairs.end(), [&](const Value& l, const Value& rr) {
    Value kl = sort_key(l.as_list()[idx], cs), kr = sort_key(rr.as_list()[idx], cs);
    return rev ? compare_values(kr, kl) < 0 : compare_values(kl, kr) < 0;
  });
  return Value::list(std::move(pairs));
}

Value f_map(Renderer& r, const Value& x, CallArgs& a) {
  ValueList out;
  bool by_attr = false;
  std::string attr;
  Value dflt;
  for (auto& [k, v] : a.kwargs) {
    if (k == "attribute") {
      by_attr = true;
      attr = v.str();
    } else if (k == "default") {
      dflt = v;
    }
  }
  if (by_attr) {
    for (const Value& v : iterate(x)) {
      Value got = r.get_path(v, attr);
      out.push_back(got.is_undefined() && !dflt.is_undefined() ? dflt : got);
    }
    return Value::list(std::move(out));
  }
  if (a.args.empty()) throw_error("map requires a filter argument");
  std::string name = a.args[0].str();
  if (!filters().count(name)) throw_error("No filter named '", name, "'");
  CallArgs rest;
  rest.args.assign(a.args.begin() + 1, a.args.end());
  rest.kwargs = a.kwargs;
  for (const Value& v : iterate(x)) {
    CallArgs copy = rest;
    out.push_back(r.apply_filter(name, v, copy));
  }
  return Value::list(std::move(out));
}

Value select_impl(Renderer& r, const Value& x, CallArgs& a, bool want, bool by_attr) {
  size_t first = by_attr ? 1 : 0;
  std::string attr = by_attr ? (a.args.empty() ? "" : a.args[0].str()) : "";
  if (by_attr && a.args.empty()) throw_error("selectattr/rejectattr need an attribute name");
  bool has_test = a.args.size() > first;
  std::string test = has_test ? a.args[first].str() : "";
  CallArgs rest;
  if (has_test) rest.args.assign(a.args.begin() + static_cast<long>(first) + 1, a.args.end());
  rest.kwargs = a.kwargs;
  ValueList out;
  for (const Value& v : iterate(x)) {
    Value subject = by_attr ? r.get_path(v, attr) : v;
    CallArgs copy = rest;
    bool ok = has_test ? r.apply_test(test, subject, copy) : subject.truthy();
    if (ok == want) out.push_back(v);
  }
  return Value::list(std::move(out));
}
Value f_select(Renderer& r, const Value& x, CallArgs& a) {
  return select_impl(r, x, a, true, false);
}
Value f_reject(Renderer& r, const Value& x, CallArgs& a) {
  return select_impl(r, x, a, false, false);
}
Value f_selectattr(Renderer& r, const Value& x, CallArgs& a) {
  return select_impl(r, x, a, true, true);
}
Value f_rejectattr(Renderer& r, const Value& x, CallArgs& a) {
  return select_impl(r, x, a, false, true);
}

Value f_int(Renderer&, const Value& x, CallArgs& a) {
  Args p("int", a, {"default", "base"});
  Value dflt = p.has(0) ? p[0] : Value::integer(0);
  int64_t base = p.has(1) ? int_arg(p[1], "base") : 10;
  if (x.is_int() || x.is_bool()) return Value::integer(x.as_int());
  if (x.is_float()) {
    if (!std::isfinite(x.as_float())) return dflt;
    return Value::integer(static_cast<int64_t>(x.as_float()));
  }
  if (x.is_string()) {
    std::string s = py_strip(x.as_string(), Value::none(), true, true);
    std::string clean;
    for (char c : s)
      if (c != '_') clean += c;
    if (!clean.empty()) {
      char* end = nullptr;
      errno = 0;
      long long v = std::strtoll(clean.c_str(), &end, static_cast<int>(base));
      if (*end == '\0' && errno == 0) return Value::integer(v);
      double d = std::strtod(clean.c_str(), &end);
      if (*end == '\0' && std::isfinite(d)) return Value::integer(static_cast<int64_t>(d));
    }
  }
  return dflt;
}

Value f_float(Renderer&, const Value& x, CallArgs& a) {
  Args p("float", a, {"default"});
  Value dflt = p.has(0) ? p[0] : Value::floating(0.0);
  if (x.is_number()) return Value::floating(x.as_float());
  if (x.is_string()) {
    std::string s = py_strip(x.as_string(), Value::none(), true, true);
    char* end = nullptr;
    double d = std::strtod(s.c_str(), &end);
    if (!s.empty() && *end == '\0') return Value::floating(d);
  }
  return dflt;
}

Value f_abs(Renderer&, const Value& x, CallArgs& a) {
  Args p("abs", a, {});
  if (x.is_float()) return Value::floating(std::fabs(x.as_float()));
  if (x.is_number()) return Value::integer(x.as_int() < 0 ? -x.as_int() : x.as_int());
  throw_error("bad operand type for abs(): '", x.type_name(), "'");
}

Value f_round(Renderer&, const Value& x, CallArgs& a) {
  Args p("round", a, {"precision", "method"});
  int64_t prec = p.has(0) ? int_arg(p[0], "precision") : 0;
  std::string method = p.has(1) ? p[1].str() : "common";
  if (!x.is_number()) throw_error("round: value must be a number, not ", x.type_name());
  if (method == "common") {
    if (!x.is_float()) return Value::integer(x.as_int());
    char buf[512];
    if (prec < 0 || prec > 300) throw_error("round: unsupported precision");
    std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(prec),
                  x.as_float());  // correctly rounded, half-even
    return Value::floating(std::strtod(buf, nullptr));
  }
  if (method != "ceil" && method != "floor") throw_error("method must be common, ceil or floor");
  double scale = std::pow(10.0, static_cast<double>(prec));
  double v = x.as_float() * scale;
  v = method == "ceil" ? std::ceil(v) : std::floor(v);
  return Value::floating(v / scale);
}

Value f_sum(Renderer& r, const Value& x, CallArgs& a) {
  Args p("sum", a, {"attribute", "start"});
  Value total = p.has(1) ? p[1] : Value::integer(0);
  for (const Value& v : iterate(x)) {
    Value item = p.present(0) ? r.get_path(v, p[0].str()) : v;
    if (!total.is_number() || !item.is_number()) throw_error("sum: unsupported operand types");
    if (total.is_float() || item.is_float())
      total = Value::floating(total.as_float() + item.as_float());
    else {
      total = Value::integer(add_i(total.as_int(), item.as_int()));
    }
  }
  return total;
}

Value minmax(Renderer& r, const Value& x, CallArgs& a, bool want_max) {
  Args p(want_max ? "max" : "min", a, {"case_sensitive", "attribute"});
  ValueList items = iterate(x);
  if (items.empty())
    return Value::undefined(std::string("No aggregated item, sequence was empty."));
  size_t best = 0;
  auto key = [&](const Value& v) {
    return sort_key(p.present(1) ? r.get_path(v, p[1].str()) : v, p[0].truthy());
  };
  for (size_t i = 1; i < items.size(); ++i) {
    int c = compare_values(key(items[i]), key(items[best]));
    if (want_max ? c > 0 : c < 0) best = i;
  }
  return items[best];
}
Value f_max(Renderer& r, const Value& x, CallArgs& a) { return minmax(r, x, a, true); }
Value f_min(Renderer& r, const Value& x, CallArgs& a) { return minmax(r, x, a, false); }

Value f_indent(Renderer&, const Value& x, CallArgs& a) {
  Args p("indent", a, {"width", "first", "blank"});
  std::string ind =
      p.has(0) ? (p[0].is_string()
                      ? p[0].as_string()
                      : std::string(
                            static_cast<size_t>(std::max<int64_t>(0, int_arg(p[0], "width"))), ' '))
               : std::string(4, ' ');
  std::string s = x.str() + "\n";
  std::vector<std::string> lines = py_splitlines(s, false);
  std::string rv;
  if (p[2].truthy()) {
    for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + ind : "") + lines[i];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : ind + lines[i]);
  }
  if (p[1].truthy()) rv = ind + rv;
  return Value::string(rv);
}

Value f_wordcount(Renderer&, const Value& x, CallArgs& a) {
  Args p("wordcount", a, {});
  int64_t n = 0;
  bool in_word = false;
  for (uint32_t c : utf8_decode(x.str())) {
    bool w = c == '_' || is_alpha(c) || is_numeric(c);
    if (w && !in_word) ++n;
    in_word = w;
  }
  return Value::integer(n);
}

Value f_center(Renderer& r, const Value& x, CallArgs& a) {
  Args p("center", a, {"width"});
  (void)r;
  std::string s = x.str();
  int64_t width = p.has(0) ? int_arg(p[0], "width") : 80;
  int64_t len = static_cast<int64_t>(utf8_length(s));
  if (width <= len) return Value::string(s);
  int64_t pad = width - len, left = pad / 2 + (pad & width & 1);
  return Value::string(std::string(static_cast<size_t>(left), ' ') + s +
                       std::string(static_cast<size_t>(pad - left), ' '));
}

Value f_attr(Renderer& r, const Value& x, CallArgs& a) {
  Args p("attr", a, {"name"});
  const std::string& name = str_arg(p[0], "attr name");
  if (x.is_dict() && !x.as_dict().find(name)) return r.get_attr(x, name);
  if (x.is_dict()) return Value::undefined("'dict object' has no attribute '" + name + "'");
  return r.get_attr(x, name);
}

const std::unordered_map<std::string, FilterFn>& filters() {
  static const std::unordered_map<std::string, FilterFn> k = {
      {"tojson", f_tojson},
      {"trim", f_trim},
      {"items", f_items},
      {"length", f_length},
      {"count", f_length},
      {"string", f_string},
      {"safe", f_safe},
      {"default", f_default},
      {"d", f_default},
      {"join", f_join},
      {"lower", f_lower},
      {"upper", f_upper},
      {"capitalize", f_capitalize},
      {"title", f_title},
      {"first", f_first},
      {"last", f_last},
      {"list", f_list},
      {"escape", f_escape},
      {"e", f_escape},
      {"forceescape", f_escape},
      {"replace", f_replace},
      {"reverse", f_reverse},
      {"sort", f_sort},
      {"unique", f_unique},
      {"dictsort", f_dictsort},
      {"map", f_map},
      {"select", f_select},
      {"reject", f_reject},
      {"selectattr", f_selectattr},
      {"rejectattr", f_rejectattr},
      {"int", f_int},
      {"float", f_float},
      {"abs", f_abs},
      {"round", f_round},
      {"sum", f_sum},
      {"max", f_max},
      {"min", f_min},
      {"indent", f_indent},
      {"wordcount", f_wordcount},
      {"center", f_center},
      {"attr", f_attr},
  };
  return k;
}

// ---------------------------------------------------------------------------------------------
// Tests (jinja2.tests)

const Value& test_arg(const Value&, CallArgs& a, const char* name) {
  if (a.args.size() != 1 || !a.kwargs.empty())
    throw_error("test '", name, "' takes exactly one argument");
  return a.args[0];
}
void no_args(CallArgs& a, const char* name) {
  if (!a.args.empty() || !a.kwargs.empty()) throw_error("test '", name, "' takes no arguments");
}

#define DS_SIMPLE_TEST(fn, name, expr)              \
  bool fn(Renderer&, const Value& x, CallArgs& a) { \
    no_args(a, name);                               \
    (void)x;                                        \
    return (expr);                                  \
  }
DS_SIMPLE_TEST(t_defined, "defined", !x.is_undefined())
DS_SIMPLE_TEST(t_undefined, "undefined", x.is_undefined())
DS_SIMPLE_TEST(t_none, "none", x.is_none())
DS_SIMPLE_TEST(t_boolean, "boolean", x.is_bool())
DS_SIMPLE_TEST(t_true, "true", x.is_bool() && x.as_bool())
DS_SIMPLE_TEST(t_false, "false", x.is_bool() && !x.as_bool())
DS_SIMPLE_TEST(t_string, "string", x.is_string())
DS_SIMPLE_TEST(t_number, "number", x.is_number())
DS_SIMPLE_TEST(t_integer, "integer", x.is_int())
DS_SIMPLE_TEST(t_float, "float", x.is_float())
DS_SIMPLE_TEST(t_mapping, "mapping", x.is_dict())
DS_SIMPLE_TEST(t_iterable, "iterable",
               x.is_string() || x.is_list() || x.is_dict() || x.is_undefined())
DS_SIMPLE_TEST(t_sequence, "sequence",
               x.is_string() || x.is_list() || x.is_dict() || x.is_undefined())
DS_SIMPLE_TEST(t_callable, "callable", x.is_function() || x.is_undefined())
DS_SIMPLE_TEST(t_escaped, "escaped", false)
DS_SIMPLE_TEST(t_lower, "lower",
               x.is_string() && !x.as_string().empty() &&
                   map_case(x.as_string(), 0) == x.as_string() &&
                   map_case(x.as_string(), 1) != x.as_string())
DS_SIMPLE_TEST(t_upper, "upper",
               x.is_string() && !x.as_string().empty() &&
                   map_case(x.as_string(), 1) == x.as_string() &&
                   map_case(x.as_string(), 0) != x.as_string())
#undef DS_SIMPLE_TEST

bool t_odd(Renderer&, const Value& x, CallArgs& a) {
  no_args(a, "odd");
  return (int_arg(x, "odd test value") % 2) != 0;
}
bool t_even(Renderer&, const Value& x, CallArgs& a) {
  no_args(a, "even");
  return (int_arg(x, "even test value") % 2) == 0;
}
bool t_divisibleby(Renderer&, const Value& x, CallArgs& a) {
  int64_t n = int_arg(test_arg(x, a, "divisibleby"), "divisibleby argument");
  if (n == 0) throw_error("integer division or modulo by zero");
  return int_arg(x, "divisibleby test value") % n == 0;
}
bool t_eq(Renderer&, const Value& x, CallArgs& a) { return values_equal(x, test_arg(x, a, "eq")); }
bool t_ne(Renderer&, const Value& x, CallArgs& a) { return !values_equal(x, test_arg(x, a, "ne")); }
bool t_lt(Renderer&, const Value& x, CallArgs& a) {
  return compare_values(x, test_arg(x, a, "lt")) < 0;
}
bool t_le(Renderer&, const Value& x, CallArgs& a) {
  return compare_values(x, test_arg(x, a, "le")) <= 0;
}
bool t_gt(Renderer&, const Value& x, CallArgs& a) {
  return compare_values(x, test_arg(x, a, "gt")) > 0;
}
bool t_ge(Renderer&, const Value& x, CallArgs& a) {
  return compare_values(x, test_arg(x, a, "ge")) >= 0;
}
bool t_in(Renderer&, const Value& x, CallArgs& a) { return contains(test_arg(x, a, "in"), x); }
bool t_sameas(Renderer&, const Value& x, CallArgs& a) {
  const Value& y = test_arg(x, a, "sameas");
  if (x.type() != y.type()) return false;
  switch (x.type()) {
    case Type::kNone:
    case Type::kUndefined:
      return true;
    case Type::kBool:
    case Type::kInt:
      return x.as_int() == y.as_int();
    case Type::kList:
      return &x.as_list() == &y.as_list();
    case Type::kDict:
      return &x.as_dict() == &y.as_dict();
    case Type::kNamespace:
      return &x.as_namespace() == &y.as_namespace();
    case Type::kFunction:
      return &x.as_function() == &y.as_function();
    default:
      return values_equal(x, y);
  }
}
bool t_filter(Renderer&, const Value& x, CallArgs& a) {
  no_args(a, "filter");
  return x.is_string() && filters().count(x.as_string());
}
bool t_test(Renderer&, const Value& x, CallArgs& a);

const std::unordered_map<std::string, TestFn>& tests() {
  static const std::unordered_map<std::string, TestFn> k = {
      {"defined", t_defined},
      {"undefined", t_undefined},
      {"none", t_none},
      {"boolean", t_boolean},
      {"true", t_true},
      {"false", t_false},
      {"string", t_string},
      {"number", t_number},
      {"integer", t_integer},
      {"float", t_float},
      {"mapping", t_mapping},
      {"iterable", t_iterable},
      {"sequence", t_sequence},
      {"callable", t_callable},
      {"escaped", t_escaped},
      {"lower", t_lower},
      {"upper", t_upper},
      {"odd", t_odd},
      {"even", t_even},
      {"divisibleby", t_divisibleby},
      {"eq", t_eq},
      {"equalto", t_eq},
      {"==", t_eq},
      {"ne", t_ne},
      {"!=", t_ne},
      {"lt", t_lt},
      {"lessthan", t_lt},
      {"<", t_lt},
      {"le", t_le},
      {"<=", t_le},
      {"gt", t_gt},
      {"greaterthan", t_gt},
      {">", t_gt},
      {"ge", t_ge},
      {">=", t_ge},
      {"in", t_in},
      {"sameas", t_sameas},
      {"filter", t_filter},
      {"test", t_test},
  };
  return k;
}
bool t_test(Renderer&, const Value& x, CallArgs& a) {
  no_args(a, "test");
  return x.is_string() && tests().count(x.as_string());
}

}  // namespace

bool is_known_filter(const std::string& name) { return filters().count(name) > 0; }
bool is_known_test(const std::string& name) { return tests().count(name) > 0; }

std::string render_program(const TemplateProgram& program, const Dict& vars) {
  Renderer r(program, vars);
  return r.run();
}

Template::Template(const std::string& source) : program_(parse_template(source)) {}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

std::string Template::render(const Dict& vars) const { return render_program(*program_, vars); }

}  // namespace jinja
}  // namespace ds
