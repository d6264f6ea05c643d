// Internal to the Jinja interpreter: tokens, the AST, and the entry points of lexer, parser and
// evaluator (jinja_lexer.cpp, jinja_parser.cpp, jinja_eval.cpp).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "chat/jinja.h"
#include "chat/jinja_value.h"

namespace ds::jinja {

enum class Tok {
  kData,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof
};

struct Token {
  Tok type;
  std::string text;  // data text, name, operator, or the decoded string literal
  int line = 0;
  int col = 0;
  int64_t int_value = 0;
  double float_value = 0;
};

// Splits a template source into tokens with jinja2's rules (trim_blocks and lstrip_blocks on,
// one trailing newline removed, comments dropped, raw blocks as data).
std::vector<Token> tokenize(const std::string& source);

enum class ExprKind {
  kConst,
  kName,
  kGetattr,
  kGetitem,
  kSlice,
  kCall,
  kFilter,
  kTest,
  kNeg,
  kPos,
  kNot,
  kBinary,
  kCompare,
  kAnd,
  kOr,
  kCond,
  kList,
  kTuple,
  kDict,
  kConcat,
  kBlockInput
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  ExprKind kind;
  int line = 0, col = 0;
  Value value;                        // kConst
  std::string name;                   // name, attribute, filter, test, binary operator
  std::vector<std::string> ops;       // kCompare: one operator per operand after the first
  std::vector<ExprPtr> kids;          // operands (see below); may hold nullptr for slices
  std::vector<std::string> kw_names;  // kCall/kFilter/kTest: names of the trailing keyword args
  size_t n_pos = 0;                   // kCall/kFilter/kTest: positional args after kids[0]
  // kGetattr/kGetitem: kids = {obj[, key]}; kSlice: {obj, start, stop, step};
  // kCall: {callee, positional..., keyword...}; kFilter/kTest: {input, positional..., keyword...}
  // (a filter's input is a kBlockInput for `{% filter %}` / `{% set x | f %}` blocks);
  // kCond: {test, then, else-or-null}; kDict: {key, value, key, value, ...}.
};

enum class StmtKind {
  kText,
  kOutput,
  kIf,
  kFor,
  kSet,
  kSetBlock,
  kMacro,
  kBreak,
  kContinue,
  kFilterBlock,
  kWith,
  kScope
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Stmt {
  StmtKind kind;
  int line = 0, col = 0;
  std::string text;                  // kText
  std::vector<ExprPtr> exprs;        // kOutput: {expr}; kIf: conditions; kFor: {iter, filter?};
                                     // kSet: {value}; kSetBlock/kFilterBlock: {filter chain};
                                     // kMacro: defaults (nullptr when none); kWith: values
  std::vector<Body> bodies;          // kIf: one per condition (+ else); kFor: {body, else};
                                     // kSetBlock/kMacro/kFilterBlock/kWith/kScope: {body}
  std::vector<std::string> targets;  // kFor/kSet/kSetBlock/kWith: names; kMacro: parameters
  std::string ns_attr;               // kSet/kSetBlock into namespace: targets[0].ns_attr
  std::string name;                  // kMacro: macro name
  bool uses_varargs = false, uses_kwargs = false;  // kMacro
};

struct TemplateProgram {
  Body body;
};

std::shared_ptr<TemplateProgram> parse_template(const std::string& source);
std::string render_program(const TemplateProgram& program, const Dict& vars);

// Filter and test names the evaluator implements (checked at parse time).
bool is_known_filter(const std::string& name);
bool is_known_test(const std::string& name);

}  // namespace ds::jinja
