// Jinja parser: tokens -> AST, with jinja2.parser's grammar and operator precedence
// (condexpr < or < and < not < compare < +,- < ~ < *,/,//,% < ** < unary < postfix/filter/test).
// Unknown tags, filters and tests are rejected here with their line and column.
#include <functional>
#include <set>

#include "chat/jinja_ast.h"

namespace ds::jinja {
namespace {

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  std::shared_ptr<TemplateProgram> run() {
    auto prog = std::make_shared<TemplateProgram>();
    prog->body = parse_body({});
    return prog;
  }

 private:
  // --- token helpers -------------------------------------------------------------------------
  const Token& cur() const { return toks_[pos_]; }
  const Token& peek(size_t k = 1) const { return toks_[std::min(pos_ + k, toks_.size() - 1)]; }
  const Token& advance() { return toks_[pos_ < toks_.size() - 1 ? pos_++ : pos_]; }
  bool is_op(const char* op) const { return cur().type == Tok::kOp && cur().text == op; }
  bool is_name(const char* name) const { return cur().type == Tok::kName && cur().text == name; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    advance();
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    advance();
    return true;
  }

  [[noreturn]] void fail(const Token& t, const std::string& msg) const {
    throw TemplateError(msg, t.line, t.col, false);
  }

  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::kEof:
        return "end of template";
      case Tok::kBlockEnd:
        return "end of statement block";
      case Tok::kVarEnd:
        return "end of print statement";
      case Tok::kData:
        return "template data";
      default:
        return "'" + t.text + "'";
    }
  }

  void expect_op(const char* op) {
    if (!skip_op(op)) fail(cur(), std::string("expected '") + op + "', got " + describe(cur()));
  }
  std::string expect_name_token() {
    if (cur().type != Tok::kName) fail(cur(), "expected a name, got " + describe(cur()));
    return advance().text;
  }
  void expect_block_end() {
    if (cur().type != Tok::kBlockEnd)
      fail(cur(), "expected end of statement block, got " + describe(cur()));
    advance();
  }

  ExprPtr node(ExprKind kind, const Token& at) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = at.line;
    e->col = at.col;
    return e;
  }

  // --- statements ----------------------------------------------------------------------------

  // Parses until `{% <one of end_names>`; leaves the position at that name token.
  Body parse_body(std::initializer_list<const char*> end_names) {
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == Tok::kEof) {
        if (end_names.size() == 0) return body;
        std::string expected;
        for (const char* n : end_names)
          expected += std::string(expected.empty() ? "" : " or ") + "'" + n + "'";
        fail(t, "unexpected end of template, expected " + expected);
      }
      if (t.type == Tok::kData) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kText;
        s->line = t.line;
        s->col = t.col;
        s->text = t.text;
        body.push_back(std::move(s));
        advance();
      } else if (t.type == Tok::kVarBegin) {
        advance();
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kOutput;
        s->line = t.line;
        s->col = t.col;
        s->exprs.push_back(parse_tuple(true));
        if (cur().type != Tok::kVarEnd)
          fail(cur(), "expected end of print statement, got " + describe(cur()));
        advance();
        body.push_back(std::move(s));
      } else if (t.type == Tok::kBlockBegin) {
        advance();
        if (cur().type == Tok::kName) {
          for (const char* n : end_names)
            if (cur().text == n) return body;
        }
        body.push_back(parse_statement());
      } else {
        fail(t, "unexpected " + describe(t));
      }
    }
  }

  std::unique_ptr<Stmt> make_stmt(StmtKind kind, const Token& at) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = at.line;
    s->col = at.col;
    return s;
  }

  std::unique_ptr<Stmt> parse_statement() {
    const Token& t = cur();
    if (t.type != Tok::kName) fail(t, "tag name expected");
    const std::string& tag = t.text;
    if (tag == "if") return parse_if();
    if (tag == "for") return parse_for();
    if (tag == "set") return parse_set();
    if (tag == "macro") return parse_macro();
    if (tag == "filter") return parse_filter_block();
    if (tag == "with") return parse_with();
    if (tag == "generation") {  // transformers' AssistantTracker: renders its body unchanged
      auto s = make_stmt(StmtKind::kScope, advance());
      expect_block_end();
      s->bodies.push_back(parse_body({"endgeneration"}));
      advance();
      expect_block_end();
      return s;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail(t, "'" + tag + "' outside of a loop");
      auto s = make_stmt(tag == "break" ? StmtKind::kBreak : StmtKind::kContinue, advance());
      expect_block_end();
      return s;
    }
    static const std::set<std::string> kEnds = {"endif",     "endfor",  "endmacro",      "endset",
                                                "endfilter", "endwith", "endgeneration", "elif",
                                                "else",      "endcall", "endblock",      "endraw"};
    if (kEnds.count(tag)) fail(t, "unexpected '" + tag + "'");
    fail(t, "unsupported tag '" + tag +
                "' (the chat-template interpreter supports if, for, set, macro, filter, "
                "with, break, continue, raw, generation)");
  }

  std::unique_ptr<Stmt> parse_if() {
    auto s = make_stmt(StmtKind::kIf, advance());
    s->exprs.push_back(parse_tuple(false));
    expect_block_end();
    while (true) {
      s->bodies.push_back(parse_body({"elif", "else", "endif"}));
      const Token& t = advance();
      if (t.text == "elif") {
        s->exprs.push_back(parse_tuple(false));
        expect_block_end();
      } else if (t.text == "else") {
        expect_block_end();
        s->bodies.push_back(parse_body({"endif"}));
        advance();
        expect_block_end();
        return s;
      } else {
        expect_block_end();
        return s;
      }
    }
  }

  // Names, optionally parenthesised / comma separated: `x`, `k, v`, `(k, v)`.
  std::vector<std::string> parse_target_names(bool allow_tuple) {
    std::vector<std::string> names;
    bool paren = allow_tuple && skip_op("(");
    while (true) {
      names.push_back(expect_name_token());
      if (!allow_tuple || !skip_op(",")) break;
      if (cur().type != Tok::kName) break;  // trailing comma
    }
    if (paren) expect_op(")");
    return names;
  }

  std::unique_ptr<Stmt> parse_for() {
    auto s = make_stmt(StmtKind::kFor, advance());
    s->targets = parse_target_names(true);
    if (!skip_name("in")) fail(cur(), "expected 'in', got " + describe(cur()));
    s->exprs.push_back(parse_tuple(false, {"recursive"}));
    if (skip_name("if")) s->exprs.push_back(parse_expression(true));
    if (is_name("recursive")) fail(cur(), "recursive loops are not supported");
    expect_block_end();
    ++loop_depth_;
    s->bodies.push_back(parse_body({"endfor", "else"}));
    --loop_depth_;
    if (advance().text == "else") {
      expect_block_end();
      s->bodies.push_back(parse_body({"endfor"}));
      advance();
    }
    expect_block_end();
    return s;
  }

  std::unique_ptr<Stmt> parse_set() {
    const Token& at = advance();
    std::vector<std::string> names;
    std::string ns_attr;
    if (cur().type == Tok::kName && peek().type == Tok::kOp && peek().text == ".") {
      names.push_back(advance().text);
      advance();
      ns_attr = expect_name_token();
    } else {
      names = parse_target_names(true);
    }
    if (skip_op("=")) {
      auto s = make_stmt(StmtKind::kSet, at);
      s->targets = names;
      s->ns_attr = ns_attr;
      s->exprs.push_back(parse_tuple(true));
      expect_block_end();
      return s;
    }
    auto s = make_stmt(StmtKind::kSetBlock, at);
    if (names.size() != 1) fail(at, "a block set assigns one name");
    s->targets = names;
    s->ns_attr = ns_attr;
    if (is_op("|")) s->exprs.push_back(parse_filter_chain(node(ExprKind::kBlockInput, cur())));
    expect_block_end();
    s->bodies.push_back(parse_body({"endset"}));
    advance();
    expect_block_end();
    return s;
  }

  std::unique_ptr<Stmt> parse_filter_block() {
    const Token& at = advance();
    auto s = make_stmt(StmtKind::kFilterBlock, at);
    // `{% filter upper %}`: the filter name without a leading pipe, then possibly more filters.
    auto input = node(ExprKind::kBlockInput, cur());
    s->exprs.push_back(parse_filter_chain(std::move(input), /*first_without_pipe=*/true));
    expect_block_end();
    s->bodies.push_back(parse_body({"endfilter"}));
    advance();
    expect_block_end();
    return s;
  }

  std::unique_ptr<Stmt> parse_with() {
    auto s = make_stmt(StmtKind::kWith, advance());
    while (cur().type != Tok::kBlockEnd) {
      if (!s->targets.empty()) expect_op(",");
      s->targets.push_back(expect_name_token());
      expect_op("=");
      s->exprs.push_back(parse_expression(true));
    }
    expect_block_end();
    s->bodies.push_back(parse_body({"endwith"}));
    advance();
    expect_block_end();
    return s;
  }

  std::unique_ptr<Stmt> parse_macro() {
    auto s = make_stmt(StmtKind::kMacro, advance());
    s->name = expect_name_token();
    expect_op("(");
    while (!is_op(")")) {
      if (!s->targets.empty()) expect_op(",");
      if (is_op(")")) break;
      s->targets.push_back(expect_name_token());
      if (skip_op("="))
        s->exprs.push_back(parse_expression(true));
      else if (!s->exprs.empty() && s->exprs.back())
        fail(cur(), "non-default argument follows default argument");
      else
        s->exprs.push_back(nullptr);
    }
    expect_op(")");
    expect_block_end();
    int saved_loop = loop_depth_;
    loop_depth_ = 0;
    std::set<std::string> names;
    name_sinks_.push_back(&names);
    s->bodies.push_back(parse_body({"endmacro"}));
    name_sinks_.pop_back();
    loop_depth_ = saved_loop;
    advance();
    expect_block_end();
    s->uses_varargs = names.count("varargs") > 0;
    s->uses_kwargs = names.count("kwargs") > 0;
    if (names.count("caller"))
      fail(*s_tok(s.get()), "macros using 'caller' (call blocks) are not supported");
    return s;
  }
  const Token* s_tok(const Stmt* s) {
    static Token t;
    t.line = s->line;
    t.col = s->col;
    return &t;
  }

  // --- expressions ---------------------------------------------------------------------------

  // Expressions separated by commas; a comma makes a tuple. Stops at end tokens and extra names.
  ExprPtr parse_tuple(bool with_condexpr, std::initializer_list<const char*> extra_end = {}) {
    const Token& at = cur();
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) {
        if (!skip_op(",")) break;
        is_tuple = true;
      }
      if (tuple_ends(extra_end)) break;
      items.push_back(parse_expression(with_condexpr));
    }
    if (!is_tuple) {
      if (items.empty()) fail(at, "expected an expression, got " + describe(at));
      return std::move(items[0]);
    }
    auto e = node(ExprKind::kTuple, at);
    e->kids = std::move(items);
    return e;
  }
  bool tuple_ends(std::initializer_list<const char*> extra_end) const {
    const Token& t = cur();
    if (t.type == Tok::kVarEnd || t.type == Tok::kBlockEnd || t.type == Tok::kEof) return true;
    if (t.type == Tok::kOp && (t.text == ")" || t.text == "]" || t.text == "}")) return true;
    if (t.type == Tok::kName)
      for (const char* n : extra_end)
        if (t.text == n) return true;
    return false;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    ExprPtr expr = parse_or();
    while (is_name("if")) {
      const Token& at = advance();
      auto e = node(ExprKind::kCond, at);
      ExprPtr test = parse_or();
      ExprPtr other = skip_name("else") ? parse_condexpr() : nullptr;
      e->kids.push_back(std::move(test));
      e->kids.push_back(std::move(expr));
      e->kids.push_back(std::move(other));
      expr = std::move(e);
    }
    return expr;
  }

  ExprPtr binary(ExprKind kind, const Token& at, ExprPtr a, ExprPtr b, const std::string& op = "") {
    auto e = node(kind, at);
    e->name = op;
    e->kids.push_back(std::move(a));
    e->kids.push_back(std::move(b));
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      const Token& at = advance();
      left = binary(ExprKind::kOr, at, std::move(left), parse_and());
    }
    return left;
  }
  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      const Token& at = advance();
      left = binary(ExprKind::kAnd, at, std::move(left), parse_not());
    }
    return left;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      auto e = node(ExprKind::kNot, advance());
      e->kids.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    const Token& at = cur();
    ExprPtr first = parse_math1();
    ExprPtr e;
    while (true) {
      std::string op;
      if (cur().type == Tok::kOp &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == ">" ||
           cur().text == "<=" || cur().text == ">=")) {
        op = advance().text;
      } else if (skip_name("in")) {
        op = "in";
      } else if (is_name("not") && peek().type == Tok::kName && peek().text == "in") {
        advance();
        advance();
        op = "notin";
      } else {
        break;
      }
      if (!e) {
        e = node(ExprKind::kCompare, at);
        e->kids.push_back(std::move(first));
      }
      e->ops.push_back(op);
      e->kids.push_back(parse_math1());
    }
    return e ? std::move(e) : std::move(first);
  }
  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& at = advance();
      left = binary(ExprKind::kBinary, at, std::move(left), parse_concat(), at.text);
    }
    return left;
  }
  ExprPtr parse_concat() {
    const Token& at = cur();
    ExprPtr first = parse_math2();
    if (!is_op("~")) return first;
    auto e = node(ExprKind::kConcat, at);
    e->kids.push_back(std::move(first));
    while (skip_op("~")) e->kids.push_back(parse_math2());
    return e;
  }
  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& at = advance();
      left = binary(ExprKind::kBinary, at, std::move(left), parse_pow(), at.text);
    }
    return left;
  }
  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      const Token& at = advance();
      left = binary(ExprKind::kBinary, at, std::move(left), parse_unary(true), "**");
    }
    return left;
  }
  ExprPtr parse_unary(bool with_filter) {
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Token& at = advance();
      e = node(at.text == "-" ? ExprKind::kNeg : ExprKind::kPos, at);
      e->kids.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    switch (t.type) {
      case Tok::kName: {
        advance();
        auto e = node(ExprKind::kConst, t);
        if (t.text == "true" || t.text == "True")
          e->value = Value::boolean(true);
        else if (t.text == "false" || t.text == "False")
          e->value = Value::boolean(false);
        else if (t.text == "none" || t.text == "None")
          e->value = Value::none();
        else {
          e->kind = ExprKind::kName;
          e->name = t.text;
          for (auto* sink : name_sinks_) sink->insert(t.text);
        }
        return e;
      }
      case Tok::kString: {
        std::string s;
        while (cur().type == Tok::kString) s += advance().text;  // adjacent literals concatenate
        auto e = node(ExprKind::kConst, t);
        e->value = Value::string(std::move(s));
        return e;
      }
      case Tok::kInt: {
        advance();
        auto e = node(ExprKind::kConst, t);
        e->value = Value::integer(t.int_value);
        return e;
      }
      case Tok::kFloat: {
        advance();
        auto e = node(ExprKind::kConst, t);
        e->value = Value::floating(t.float_value);
        return e;
      }
      case Tok::kOp:
        if (t.text == "(") {
          advance();
          if (skip_op(")")) {
            auto e = node(ExprKind::kTuple, t);
            return e;
          }
          ExprPtr inner = parse_expression(true);
          if (is_op(",")) {
            auto e = node(ExprKind::kTuple, t);
            e->kids.push_back(std::move(inner));
            while (skip_op(",")) {
              if (is_op(")")) break;
              e->kids.push_back(parse_expression(true));
            }
            inner = std::move(e);
          }
          expect_op(")");
          return inner;
        }
        if (t.text == "[") {
          advance();
          auto e = node(ExprKind::kList, t);
          while (!is_op("]")) {
            if (!e->kids.empty()) expect_op(",");
            if (is_op("]")) break;
            e->kids.push_back(parse_expression(true));
          }
          expect_op("]");
          return e;
        }
        if (t.text == "{") {
          advance();
          auto e = node(ExprKind::kDict, t);
          while (!is_op("}")) {
            if (!e->kids.empty()) expect_op(",");
            if (is_op("}")) break;
            e->kids.push_back(parse_expression(true));
            expect_op(":");
            e->kids.push_back(parse_expression(true));
          }
          expect_op("}");
          return e;
        }
        break;
      default:
        break;
    }
    fail(t, "unexpected " + describe(t));
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".")) {
        const Token& at = advance();
        if (cur().type == Tok::kName) {
          auto g = node(ExprKind::kGetattr, at);
          g->name = advance().text;
          g->kids.push_back(std::move(e));
          e = std::move(g);
        } else if (cur().type == Tok::kInt) {
          auto g = node(ExprKind::kGetitem, at);
          auto k = node(ExprKind::kConst, cur());
          k->value = Value::integer(advance().int_value);
          g->kids.push_back(std::move(e));
          g->kids.push_back(std::move(k));
          e = std::move(g);
        } else {
          fail(cur(), "expected an attribute name after '.', got " + describe(cur()));
        }
      } else if (is_op("[")) {
        e = parse_subscript(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr obj) {
    const Token& at = advance();  // '['
    std::vector<ExprPtr> parts;   // slice parts when is_slice
    bool is_slice = false;
    ExprPtr key;
    auto parse_part = [&]() -> ExprPtr {
      if (is_op(":") || is_op("]")) return nullptr;
      return parse_expression(true);
    };
    key = parse_part();
    if (is_op(":")) {
      is_slice = true;
      advance();
      parts.push_back(std::move(key));
      parts.push_back(parse_part());
      if (skip_op(":"))
        parts.push_back(parse_part());
      else
        parts.push_back(nullptr);
    } else if (!key) {
      fail(cur(), "expected a subscript, got " + describe(cur()));
    } else if (is_op(",")) {
      auto t = node(ExprKind::kTuple, at);
      t->kids.push_back(std::move(key));
      while (skip_op(",")) {
        if (is_op("]")) break;
        t->kids.push_back(parse_expression(true));
      }
      key = std::move(t);
    }
    expect_op("]");
    if (is_slice) {
      auto s = node(ExprKind::kSlice, at);
      s->kids.push_back(std::move(obj));
      for (auto& p : parts) s->kids.push_back(std::move(p));
      return s;
    }
    auto g = node(ExprKind::kGetitem, at);
    g->kids.push_back(std::move(obj));
    g->kids.push_back(std::move(key));
    return g;
  }

  // Appends `(args)` to e (kids[0] already set): positional then keyword arguments.
  void parse_call_args(Expr* e) {
    expect_op("(");
    std::vector<ExprPtr> pos_args, kw_args;
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail(cur(), "*args / **kwargs in calls are not supported");
      if (cur().type == Tok::kName && peek().type == Tok::kOp && peek().text == "=") {
        e->kw_names.push_back(advance().text);
        advance();
        kw_args.push_back(parse_expression(true));
      } else {
        if (!kw_args.empty()) fail(cur(), "positional argument follows keyword argument");
        pos_args.push_back(parse_expression(true));
      }
    }
    expect_op(")");
    e->n_pos = pos_args.size();
    for (auto& a : pos_args) e->kids.push_back(std::move(a));
    for (auto& a : kw_args) e->kids.push_back(std::move(a));
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto e = node(ExprKind::kCall, cur());
    e->kids.push_back(std::move(callee));
    parse_call_args(e.get());
    return e;
  }

  std::string parse_dotted_name() {
    std::string name = expect_name_token();
    while (is_op(".")) {
      advance();
      name += "." + expect_name_token();
    }
    return name;
  }

  ExprPtr parse_filter_chain(ExprPtr input, bool first_without_pipe = false) {
    bool first = true;
    while ((first && first_without_pipe) || is_op("|")) {
      if (!(first && first_without_pipe)) advance();
      first = false;
      const Token& at = cur();
      auto f = node(ExprKind::kFilter, at);
      f->name = parse_dotted_name();
      if (!is_known_filter(f->name)) fail(at, "no filter named '" + f->name + "'");
      f->kids.push_back(std::move(input));
      if (is_op("(")) parse_call_args(f.get());
      input = std::move(f);
    }
    return input;
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        e = parse_filter_chain(std::move(e));
      } else if (is_name("is")) {
        e = parse_test(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_test(ExprPtr input) {
    const Token& at = advance();  // 'is'
    bool negated = skip_name("not");
    const Token& name_tok = cur();
    auto t = node(ExprKind::kTest, name_tok);
    t->name = parse_dotted_name();
    if (!is_known_test(t->name)) fail(name_tok, "no test named '" + t->name + "'");
    t->kids.push_back(std::move(input));
    const Token& c = cur();
    if (is_op("(")) {
      parse_call_args(t.get());
    } else if ((c.type == Tok::kName || c.type == Tok::kString || c.type == Tok::kInt ||
                c.type == Tok::kFloat ||
                (c.type == Tok::kOp && (c.text == "(" || c.text == "[" || c.text == "{"))) &&
               !(c.type == Tok::kName && (c.text == "else" || c.text == "or" || c.text == "and"))) {
      if (c.type == Tok::kName && c.text == "is")
        fail(c, "You cannot chain multiple tests with is");
      ExprPtr arg = parse_postfix(parse_primary());
      t->kids.push_back(std::move(arg));
      t->n_pos = 1;
    }
    if (!negated) return t;
    auto n = node(ExprKind::kNot, at);
    n->kids.push_back(std::move(t));
    return n;
  }

  std::vector<Token> toks_;
  size_t pos_ = 0;
  int loop_depth_ = 0;
  std::vector<std::set<std::string>*> name_sinks_;
};

}  // namespace

std::shared_ptr<TemplateProgram> parse_template(const std::string& source) {
  return Parser(tokenize(source)).run();
}

}  // namespace ds::jinja
