// A Jinja2 interpreter for chat templates, configured as Hugging Face transformers configures its
// environment (ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the
// loopcontrols extension, its `{% generation %}` tag, and the globals raise_exception,
// strftime_now, namespace, dict; tojson = json.dumps(ensure_ascii=False, ...)).
// Covers the statements for/if/set/macro/filter/with/break/continue/raw, the whole expression
// grammar, jinja2's filters and tests, and the str/dict/list methods templates call. Anything it
// does not support fails with the template's line and column instead of rendering differently.
#pragma once

#include <memory>
#include <string>

#include "chat/jinja_value.h"
#include "core/error.h"

namespace ds {

// Error while parsing or rendering a template. For raise_exception(msg) what() is exactly msg;
// for everything else it is "line L, column C: message".
class TemplateError : public Error {
 public:
  TemplateError(const std::string& message, int line, int column, bool raised);
  const std::string& message() const { return message_; }
  int line() const { return line_; }
  int column() const { return column_; }
  bool raised_by_template() const { return raised_; }

 private:
  std::string message_;
  int line_ = 0;
  int column_ = 0;
  bool raised_ = false;
};

namespace jinja {

struct TemplateProgram;  // parsed template (jinja_ast.h)

class Template {
 public:
  // Parses the source; throws TemplateError (with line/column) on syntax errors, unknown tags,
  // filters or tests.
  explicit Template(const std::string& source);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // Renders with the given top-level variables (a dict). Throws TemplateError.
  std::string render(const Dict& vars) const;

 private:
  std::shared_ptr<const TemplateProgram> program_;
};

}  // namespace jinja
}  // namespace ds
