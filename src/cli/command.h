// Subcommand registry of the `deltaserve` binary. Each cmd_*.cpp file registers its commands with
// a static DS_COMMAND(...) so adding a command never touches main.cpp.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

namespace ds::cli {

// Adds the options of one subcommand to `app` and returns the action to run once parsed. The
// action returns the process exit code; ds::Error thrown from it becomes "error: ..." and exit 1.
using CommandSetup = std::function<std::function<int()>(CLI::App& app)>;

struct CommandRegistrar {
  CommandRegistrar(const char* name, const char* help, CommandSetup setup);
};

// `--device cpu|cuda` parsing shared by every command that runs the model.
void add_device_option(CLI::App& app, std::string& device);

}  // namespace ds::cli

#define DS_CLI_CONCAT2(a, b) a##b
#define DS_CLI_CONCAT(a, b) DS_CLI_CONCAT2(a, b)
#define DS_COMMAND(name, help, setup) \
  static ::ds::cli::CommandRegistrar DS_CLI_CONCAT(ds_command_, __LINE__)(name, help, setup)
