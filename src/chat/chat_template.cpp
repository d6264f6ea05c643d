// Chat templates: loading from a model folder and rendering with transformers' conventions.
#include "chat/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/file_io.h"

namespace ds {
namespace {

using ojson = nlohmann::ordered_json;

std::string read_file(const std::filesystem::path& p) {
  return read_regular_file(p.string(), kMaxTokenizerFileBytes);
}

ojson read_json(const std::filesystem::path& p) {
  const std::string text = read_file(p);
  check_json_depth(text, kMaxTokenizerJsonDepth, p.string());
  try {
    return ojson::parse(text);
  } catch (const ojson::exception& e) {
    throw_error(p.string(), ": not valid JSON: ", e.what());
  }
}

std::shared_ptr<const jinja::Template> compile(const std::string& source,
                                               const std::string& where) {
  try {
    return std::make_shared<const jinja::Template>(source);
  } catch (const TemplateError& e) {
    throw TemplateError("chat template of " + where + ": " + e.message(), e.line(), e.column(),
                        false);
  }
}

// transformers' special_tokens_map: the standard special tokens that are set.
jinja::Dict special_tokens_from(const ojson& cfg) {
  jinja::Dict d;
  if (!cfg.is_object()) return d;
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                          "cls_token", "mask_token"}) {
    auto it = cfg.find(key);
    if (it == cfg.end()) continue;
    if (it->is_string())
      d.set(key, jinja::Value::string(it->get<std::string>()));
    else if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
      d.set(key, jinja::Value::string((*it)["content"].get<std::string>()));
  }
  return d;
}

// transformers' _normalize_chat_messages + _alias_reasoning_fields for one message.
ojson normalize_message(const ojson& msg, size_t index) {
  if (!msg.is_object())
    throw_error("messages[", index, "]: chat messages must be JSON objects, got ", msg.type_name());
  ojson m = ojson::object();
  for (auto it = msg.begin(); it != msg.end(); ++it)
    if (!it.value().is_null()) m[it.key()] = it.value();
  const ojson* reasoning = nullptr;
  for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
    auto it = m.find(key);
    if (it != m.end()) {
      reasoning = &*it;
      break;
    }
  }
  if (!reasoning) return m;
  ojson r = *reasoning;
  ojson out = ojson::object();
  out["thinking"] = r;
  for (auto it = m.begin(); it != m.end(); ++it) out[it.key()] = it.value();
  out["reasoning_content"] = r;
  return out;
}

}  // namespace

ChatTemplate ChatTemplate::from_string(const std::string& source, const ojson& special_tokens) {
  ChatTemplate t;
  t.source_ = source;
  t.template_ = compile(source, "<string>");
  t.special_tokens_ = special_tokens_from(special_tokens);
  return t;
}

ChatTemplate ChatTemplate::load(const std::string& dir) {
  namespace fs = std::filesystem;
  fs::path root(dir);
  DS_CHECK(fs::is_directory(root), "tokenizer folder ", dir, " does not exist or is not a folder");
  fs::path cfg_path = root / "tokenizer_config.json";
  fs::path jinja_path = root / "chat_template.jinja";
  fs::path json_path = root / "chat_template.json";
  ojson cfg = fs::exists(cfg_path) ? read_json(cfg_path) : ojson::object();

  ChatTemplate t;
  t.special_tokens_ = special_tokens_from(cfg);
  std::string where;
  if (fs::exists(jinja_path)) {
    t.source_ = read_file(jinja_path);
    where = jinja_path.string();
  } else if (cfg.is_object() && cfg.contains("chat_template")) {
    const ojson& ct = cfg["chat_template"];
    where = cfg_path.string();
    if (ct.is_string()) {
      t.source_ = ct.get<std::string>();
    } else if (ct.is_array()) {
      bool found = false;
      for (const ojson& entry : ct) {
        DS_CHECK(entry.is_object() && entry.contains("name") && entry.contains("template") &&
                     entry["name"].is_string() && entry["template"].is_string(),
                 cfg_path.string(),
                 ": chat_template list entries must be {\"name\": ..., \"template\": ...}");
        std::string name = entry["name"].get<std::string>();
        if (name == "default") {
          t.source_ = entry["template"].get<std::string>();
          found = true;
        } else if (name == "tool_use") {
          t.tool_template_ = compile(entry["template"].get<std::string>(), where + " (tool_use)");
        }
      }
      DS_CHECK(found, cfg_path.string(), ": chat_template list has no \"default\" template");
    } else {
      throw_error(cfg_path.string(),
                  ": \"chat_template\" must be a string or a list of named templates");
    }
  } else if (fs::exists(json_path)) {
    ojson j = read_json(json_path);
    DS_CHECK(j.is_object() && j.contains("chat_template") && j["chat_template"].is_string(),
             json_path.string(), ": expected {\"chat_template\": \"...\"}");
    t.source_ = j["chat_template"].get<std::string>();
    where = json_path.string();
  } else {
    throw_error("no chat template in ", dir,
                " (looked for chat_template.jinja, \"chat_template\" in ",
                "tokenizer_config.json, and chat_template.json)");
  }
  t.template_ = compile(t.source_, where);
  return t;
}

std::string ChatTemplate::render(const ojson& request) const {
  DS_CHECK(request.is_object(), "chat template request must be a JSON object");
  auto msgs = request.find("messages");
  DS_CHECK(msgs != request.end(), "chat template request has no \"messages\"");
  DS_CHECK(msgs->is_array(), "\"messages\" must be a list of message objects");
  DS_CHECK(!msgs->empty(),
           "Cannot apply chat template to an empty conversation. Provide at least one message.");

  ojson messages = ojson::array();
  for (size_t i = 0; i < msgs->size(); ++i) messages.push_back(normalize_message((*msgs)[i], i));

  auto agp = request.find("add_generation_prompt");
  bool add_generation_prompt = agp != request.end() && agp->is_boolean() && agp->get<bool>();

  // continue_final_message (true, or the name of the field to continue): the last message is left
  // open for the model to continue, as transformers does it: render it with a tag appended, then
  // cut the prompt at the tag.
  static const std::string kTag = "CONTINUE_FINAL_MESSAGE_TAG ";
  std::string final_text;
  bool cont = false;
  if (auto c = request.find("continue_final_message"); c != request.end() && !c->is_null()) {
    DS_CHECK(c->is_boolean() || c->is_string(),
             "\"continue_final_message\" must be a boolean or a field name");
    cont = c->is_string() || c->get<bool>();
  }
  if (cont) {
    const ojson& c = request["continue_final_message"];
    std::string field = c.is_string() ? c.get<std::string>() : "content";
    DS_CHECK(!add_generation_prompt,
             "continue_final_message and add_generation_prompt are not compatible. Use "
             "continue_final_message when you want the model to continue the final message, and "
             "add_generation_prompt when you want to add a header that will prompt it to start a "
             "new assistant message instead.");
    ojson& last = messages.back();
    DS_CHECK(last.contains(field) && !last[field].is_null(),
             "continue_final_message is set but the final message has no \"", field,
             "\" to continue!");
    const ojson final_value = last[field];
    std::vector<std::string> fields = {field};
    if (field == "reasoning_content" || field == "thinking" || field == "reasoning") {
      fields.clear();
      for (const char* f : {"reasoning_content", "thinking", "reasoning"})
        if (last.contains(f) && last[f] == final_value) fields.push_back(f);
    }
    bool in_template = false;
    for (const auto& f : fields) in_template = in_template || source_.find(f) != std::string::npos;
    DS_CHECK(in_template, "continue_final_message is set to \"", field,
             "\" but this is not an accepted field in the chat_template");
    if (final_value.is_array()) {
      bool found = false;
      for (auto it = last[field].rbegin(); it != last[field].rend(); ++it) {
        if (it->is_object() && it->contains("text") && (*it)["text"].is_string()) {
          final_text = (*it)["text"].get<std::string>();
          (*it)["text"] = final_text + kTag;
          found = true;
          break;
        }
      }
      DS_CHECK(found,
               "continue_final_message is set but we could not find any text to continue in the "
               "final message!");
    } else {
      DS_CHECK(final_value.is_string(), "continue_final_message: the final message's \"", field,
               "\" must be a string or a list of text parts");
      final_text = final_value.get<std::string>();
      for (const auto& f : fields) last[f] = last[f].get<std::string>() + kTag;
    }
  }

  jinja::Dict vars = special_tokens_;
  for (auto it = request.begin(); it != request.end(); ++it) {
    const std::string& k = it.key();
    if (k == "messages" || k == "tools" || k == "documents" || k == "add_generation_prompt" ||
        k == "continue_final_message")
      continue;
    vars.set(k, jinja::Value::from_json(it.value()));
  }
  auto tools = request.find("tools");
  bool has_tools = tools != request.end() && !tools->is_null();
  if (has_tools) DS_CHECK(tools->is_array(), "\"tools\" must be a list of tool definitions");
  vars.set("messages", jinja::Value::from_json(messages));
  vars.set("tools", has_tools ? jinja::Value::from_json(*tools) : jinja::Value::none());
  auto docs = request.find("documents");
  vars.set("documents",
           docs != request.end() ? jinja::Value::from_json(*docs) : jinja::Value::none());
  vars.set("add_generation_prompt",
           agp != request.end() ? jinja::Value::from_json(*agp) : jinja::Value::boolean(false));

  const jinja::Template& tmpl = (has_tools && tool_template_) ? *tool_template_ : *template_;
  std::string prompt = tmpl.render(vars);
  if (!cont) return prompt;

  auto ascii_space = [](char c) {
    return static_cast<unsigned char>(c) < 0x80 &&
           jinja::is_python_space(static_cast<unsigned char>(c));
  };
  auto strip = [&](const std::string& s) {  // Python str.strip(), for ASCII whitespace
    size_t b = 0, e = s.size();
    while (b < e && ascii_space(s[b])) ++b;
    while (e > b && ascii_space(s[e - 1])) --e;
    return s.substr(b, e - b);
  };
  std::string tag = strip(kTag);
  DS_CHECK(
      prompt.find(strip(final_text)) != std::string::npos && prompt.find(tag) != std::string::npos,
      "continue_final_message is set but the final message does not appear in the chat after "
      "applying the chat template! This can happen if the chat template deletes portions of "
      "the final message.");
  size_t loc = prompt.rfind(tag);
  if (prompt.compare(loc, kTag.size(), kTag) == 0) return prompt.substr(0, loc);
  std::string head = prompt.substr(0, loc);
  size_t e = head.size();
  while (e > 0 && ascii_space(head[e - 1])) --e;
  return head.substr(0, e);
}

std::string ChatTemplate::render(const nlohmann::json& request) const {
  return render(ojson::parse(request.dump()));
}

}  // namespace ds
