// Values of the Jinja interpreter, with the Python semantics that chat templates observe:
// truthiness, str() / repr() of every type (floats as Python's shortest repr), ==, ordering,
// and json.dumps(..., ensure_ascii=False) as transformers' `tojson` filter calls it.
// Strings are UTF-8; lengths, indices and slices count code points like Python's str.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ds::jinja {

class Value;
// json.dumps options: indent (pretty) with its unit, separators, sort_keys.
struct JsonOptions {
  bool pretty = false;
  std::string indent;           // one level of indentation when pretty
  std::string item_sep = ", ";  // ", " by default, "," when pretty
  std::string key_sep = ": ";
  bool sort_keys = false;
};
using ValueList = std::vector<Value>;

// Insertion-ordered mapping with string keys (Python dict as JSON produces it).
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value v);  // replaces in place, or appends
};

// jinja2's namespace(): the one mutable object of a template.
struct Namespace {
  Dict attrs;
};

// Arguments of a call: positional, then keyword (in call order).
struct CallArgs {
  ValueList args;
  std::vector<std::pair<std::string, Value>> kwargs;
};

// Builtin function, bound method or macro.
struct Function {
  std::string name;
  std::function<Value(CallArgs&)> call;
};

enum class Type : uint8_t {
  kUndefined,
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kList,
  kDict,
  kNamespace,
  kFunction
};

class Value {
 public:
  Value() = default;  // undefined
  static Value undefined(std::string hint = {});
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value floating(double f);
  static Value string(std::string s);
  static Value list(ValueList items, bool tuple = false);
  static Value dict(Dict d);
  static Value make_namespace(Dict attrs);
  static Value function(std::string name, std::function<Value(CallArgs&)> fn);
  static Value from_json(const nlohmann::ordered_json& j);

  Type type() const { return type_; }
  bool is_undefined() const { return type_ == Type::kUndefined; }
  bool is_none() const { return type_ == Type::kNone; }
  bool is_bool() const { return type_ == Type::kBool; }
  bool is_int() const { return type_ == Type::kInt; }  // bool excluded
  bool is_float() const { return type_ == Type::kFloat; }
  bool is_number() const {
    return type_ == Type::kInt || type_ == Type::kFloat || type_ == Type::kBool;
  }
  bool is_string() const { return type_ == Type::kString; }
  bool is_list() const { return type_ == Type::kList; }
  bool is_tuple() const { return type_ == Type::kList && tuple_; }
  bool is_dict() const { return type_ == Type::kDict; }
  bool is_namespace() const { return type_ == Type::kNamespace; }
  bool is_function() const { return type_ == Type::kFunction; }

  bool as_bool() const { return i_ != 0; }
  int64_t as_int() const { return i_; }  // also bool as 0/1
  double as_float() const { return type_ == Type::kFloat ? f_ : static_cast<double>(i_); }
  const std::string& as_string() const;  // kString (or the hint of an undefined)
  const ValueList& as_list() const;
  const Dict& as_dict() const;
  Namespace& as_namespace() const;
  const Function& as_function() const;

  bool truthy() const;            // Python bool()
  std::string str() const;        // Python str(); undefined -> ""
  std::string repr() const;       // Python repr()
  std::string type_name() const;  // jinja2's names: 'dict object', 'str object', ...
  // json.dumps(v, ensure_ascii=False, ...); throws ds::Error for values JSON cannot hold.
  std::string to_json(const struct JsonOptions& opt) const;

 private:
  static Value from_json_depth(const nlohmann::ordered_json& j, int depth);

  Type type_ = Type::kUndefined;
  bool tuple_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::shared_ptr<const void> p_;
};

bool values_equal(const Value& a, const Value& b);  // Python ==
// Python <: -1, 0, 1; throws ds::Error for types Python cannot order.
int compare_values(const Value& a, const Value& b);

// Python float repr ("1.0", "1e+16", "1.5e-07", "inf", "nan").
std::string python_float_repr(double f);

// UTF-8 helpers with Python str semantics (code points).
std::vector<uint32_t> utf8_decode(std::string_view s);  // invalid bytes decode as U+FFFD
void utf8_append(std::string& out, uint32_t cp);
size_t utf8_length(std::string_view s);
bool is_python_space(uint32_t cp);  // str.isspace()

}  // namespace ds::jinja
