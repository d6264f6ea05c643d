// deltaserve: the one binary. Subcommands register themselves (see command.h).
#include <cstdio>
#include <exception>
#include <map>
#include <memory>

#include "cli/command.h"
#include "core/error.h"

namespace ds::cli {
namespace {
struct Entry {
  std::string help;
  CommandSetup setup;
};
std::map<std::string, Entry>& registry() {
  static std::map<std::string, Entry> r;
  return r;
}
}  // namespace

CommandRegistrar::CommandRegistrar(const char* name, const char* help, CommandSetup setup) {
  registry()[name] = Entry{help, std::move(setup)};
}

void add_device_option(CLI::App& app, std::string& device) {
  app.add_option("--device", device, "Where the model runs: cpu, or cuda / cuda:N (needs a CUDA build)")
      ->capture_default_str();
}

}  // namespace ds::cli

int main(int argc, char** argv) {
  CLI::App app{
      "deltaserve: inference engine and OpenAI-compatible server for Qwen3.5 hybrid models "
      "(Gated DeltaNet + gated attention)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("deltaserve 0.1.0"));
  std::map<CLI::App*, std::function<int()>> actions;
  for (auto& [name, entry] : ds::cli::registry()) {
    CLI::App* sub = app.add_subcommand(name, entry.help);
    actions[sub] = entry.setup(*sub);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& [sub, action] : actions) {
      if (sub->parsed()) return action();
    }
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: unexpected failure: %s\n", e.what());
    return 1;
  }
  return 0;
}
