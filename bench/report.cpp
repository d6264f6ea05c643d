// Terminal tables and the JSON document of a bench run (see bench.h). Units in the JSON: seconds,
// bytes, FLOPs, bytes/s and FLOP/s (no prefixes); ratios are measured / floor (1.0 = at the floor).
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "core/error.h"

namespace ds::bench {
namespace {

using Json = nlohmann::json;

// A left-aligned first column, right-aligned others, widths from the contents.
class Table {
 public:
  explicit Table(std::vector<std::string> head) { rows_.push_back(std::move(head)); }
  void row(std::vector<std::string> r) { rows_.push_back(std::move(r)); }
  void print(const std::string& title) const {
    std::vector<size_t> w;
    for (const auto& r : rows_)
      for (size_t i = 0; i < r.size(); ++i) {
        if (w.size() <= i) w.push_back(0);
        w[i] = std::max(w[i], r[i].size());
      }
    std::printf("\n== %s\n", title.c_str());
    for (size_t ri = 0; ri < rows_.size(); ++ri) {
      const auto& r = rows_[ri];
      std::string line;
      for (size_t i = 0; i < r.size(); ++i) {
        const std::string pad(w[i] - r[i].size(), ' ');
        line += i == 0 ? r[i] + pad : "  " + pad + r[i];
      }
      std::printf("%s\n", line.c_str());
      if (ri == 0) {
        size_t total = 0;
        for (size_t x : w) total += x + 2;
        std::printf("%s\n", std::string(total > 2 ? total - 2 : 0, '-').c_str());
      }
    }
    std::fflush(stdout);
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}
std::string ms(double s) { return s < 0 ? "-" : fmt("%.3f", s * 1e3); }
std::string us(double s) { return s < 0 ? "-" : fmt("%.2f", s * 1e6); }
std::string ratio(double measured, double floor) {
  return floor > 0 ? fmt("%.2fx", measured / floor) : "-";
}
Json ratio_json(double measured, double floor) {
  return floor > 0 ? Json(measured / floor) : Json(nullptr);
}
std::string tbs(double bps) { return fmt("%.2f", bps / 1e12); }

}  // namespace

nlohmann::json to_json(const Summary& s) {
  return Json{{"n", s.n},     {"mean", s.mean}, {"stddev", s.stddev},
              {"min", s.min}, {"max", s.max},   {"p10", s.p10},
              {"p50", s.p50}, {"p90", s.p90},   {"p99", s.p99}};
}

Report::Report() {
  doc_ = Json::object();
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  doc_["meta"]["date"] = buf;
  doc_["notes"] = Json::array();
}

void Report::set_meta(const std::string& key, const nlohmann::json& value) {
  doc_["meta"][key] = value;
}

void Report::add_note(const std::string& text) {
  std::printf("note: %s\n", text.c_str());
  std::fflush(stdout);
  doc_["notes"].push_back(text);
}

void Report::add_ceilings(const Ceilings& c) {
  Table t({"ceiling", "measured", "per repetition (median)", "spread p10-p90"});
  t.row({"streaming read (bf16 sum)", tbs(c.read_bps) + " TB/s", us(c.read_s.p50) + " us",
         us(c.read_s.p10) + "-" + us(c.read_s.p90) + " us"});
  t.row({"device-to-device copy (R+W)", tbs(c.copy_bps) + " TB/s", us(c.copy_s.p50) + " us",
         us(c.copy_s.p10) + "-" + us(c.copy_s.p90) + " us"});
  t.row({"bf16 GEMM 8192^3 (cuBLASLt)", fmt("%.0f", c.gemm_flops / 1e12) + " TFLOP/s",
         us(c.gemm_s.p50) + " us", us(c.gemm_s.p10) + "-" + us(c.gemm_s.p90) + " us"});
  t.print("ceilings on " + c.device);
  doc_["ceilings"] = Json{{"device", c.device},
                          {"l2_bytes", c.l2_bytes},
                          {"read_bytes_per_s", c.read_bps},
                          {"copy_bytes_per_s", c.copy_bps},
                          {"gemm_flops_per_s", c.gemm_flops},
                          {"read_s", to_json(c.read_s)},
                          {"copy_s", to_json(c.copy_s)},
                          {"gemm_s", to_json(c.gemm_s)},
                          {"read_bytes", c.read_bytes},
                          {"copy_bytes", c.copy_bytes},
                          {"gemm_flop", c.gemm_flop}};
}

void Report::add_kernels(const std::vector<KernelResult>& r) {
  Table t({"family.variant", "op", "shape", "time us", "GB/s", "TFLOP/s", "floor us", "of SOL",
           "bound", "fallback us", "match"});
  Json arr = Json::array();
  for (const auto& k : r) {
    if (k.time_s <= 0) {  // a failed case
      t.row({k.family + "." + k.variant, k.op, k.shape, "-", "-", "-", "-", "-", "-", "-", k.note});
      arr.push_back(Json{{"family", k.family},
                         {"variant", k.variant},
                         {"op", k.op},
                         {"shape", k.shape},
                         {"time_s", nullptr},
                         {"note", k.note}});
      continue;
    }
    const double gbs = k.time_s > 0 ? k.bytes / k.time_s / 1e9 : 0;
    const double tf = k.time_s > 0 ? k.flops / k.time_s / 1e12 : 0;
    t.row({k.family + "." + k.variant, k.op, k.shape, us(k.time_s), fmt("%.0f", gbs),
           fmt("%.1f", tf), us(k.floor_s),
           k.time_s > 0 ? fmt("%.0f%%", 100.0 * k.floor_s / k.time_s) : "-",
           k.memory_bound ? "mem" : "flop",
           k.fallback.empty() ? "-" : us(k.fallback_time_s) + " (" + k.fallback + ")",
           k.match.empty() ? "-" : k.match});
    arr.push_back(
        Json{{"family", k.family},
             {"variant", k.variant},
             {"op", k.op},
             {"shape", k.shape},
             {"time_s", k.time_s},
             {"samples", to_json(k.samples)},
             {"bytes", k.bytes},
             {"flops", k.flops},
             {"floor_s", k.floor_s},
             {"fraction_of_floor", k.time_s > 0 ? Json(k.floor_s / k.time_s) : Json(nullptr)},
             {"memory_bound", k.memory_bound},
             {"fallback", k.fallback},
             {"fallback_time_s", k.fallback_time_s >= 0 ? Json(k.fallback_time_s) : Json(nullptr)},
             {"match", k.match},
             {"note", k.note}});
  }
  t.print(
      "kernels (median of CUDA-graph replays, inputs rotated past L2; 'of SOL' = roofline floor / "
      "time)");
  doc_["kernels"] = arr;
}

void Report::add_profile(const std::vector<Profile>& ps) {
  Json arr = Json::array();
  for (const auto& p : ps) {
    Table t({"kernel class", "launches", "time us", "share", "GB/s", "TFLOP/s"});
    Json entries = Json::array();
    for (const auto& e : p.entries) {
      t.row({e.kernel, std::to_string(e.launches), us(e.time_s), fmt("%.1f%%", 100 * e.share),
             e.time_s > 0 ? fmt("%.0f", e.bytes / e.time_s / 1e9) : "-",
             e.time_s > 0 ? fmt("%.1f", e.flops / e.time_s / 1e12) : "-"});
      entries.push_back(Json{{"kernel", e.kernel},
                             {"launches", e.launches},
                             {"time_s", e.time_s},
                             {"bytes", e.bytes},
                             {"flops", e.flops},
                             {"share", e.share}});
    }
    t.row({"sum of kernels", "", us(p.kernel_sum_s), "100%", "", ""});
    if (p.measured_s > 0)
      t.row({"measured step (engine)", "", us(p.measured_s),
             fmt("%.1f%% gaps/host", 100 * (p.measured_s - p.kernel_sum_s) / p.measured_s), "",
             ""});
    t.print("profile: " + p.phase + " " + p.shape);
    arr.push_back(Json{{"phase", p.phase},
                       {"shape", p.shape},
                       {"entries", entries},
                       {"kernel_sum_s", p.kernel_sum_s},
                       {"measured_s", p.measured_s > 0 ? Json(p.measured_s) : Json(nullptr)},
                       {"method", p.method}});
  }
  std::printf("(%s)\n", ps.empty() ? "" : ps.front().method.c_str());
  doc_["profile"] = arr;
}

void Report::add_prefill(const std::vector<PrefillResult>& r, const Ceilings& c) {
  Table t({"prompt", "runs", "TTFT ms (p50)", "min", "max", "tok/s", "TFLOP/s", "floor ms",
           "TTFT/floor"});
  Json arr = Json::array();
  for (const auto& p : r) {
    t.row({std::to_string(p.prompt), std::to_string(p.ttft_s.n), ms(p.ttft_s.p50), ms(p.ttft_s.min),
           ms(p.ttft_s.max), fmt("%.0f", p.tok_per_s), fmt("%.1f", p.tflops), ms(p.floor_s),
           ratio(p.ttft_s.p50, p.floor_s)});
    arr.push_back(Json{{"prompt", p.prompt},
                       {"ttft_s", to_json(p.ttft_s)},
                       {"tok_per_s", p.tok_per_s},
                       {"tflops", p.tflops},
                       {"flops", Json{{"linear", p.flops.linear},
                                      {"attention", p.flops.attention},
                                      {"gdn", p.flops.gdn},
                                      {"total", p.flops.total()}}},
                       {"floor_s", p.floor_s > 0 ? Json(p.floor_s) : Json(nullptr)},
                       {"ratio", ratio_json(p.ttft_s.p50, p.floor_s)}});
  }
  t.print(std::string(
              "prefill (TTFT = one step() with the whole prompt, host clock; floor = FLOPs / ") +
          (c.valid ? fmt("%.0f TFLOP/s GEMM ceiling)", c.gemm_flops / 1e12) : "no ceiling)"));
  doc_["prefill"] = arr;
}

void Report::add_decode(const std::vector<DecodeResult>& r, const Ceilings& c) {
  Table t({"batch", "context", "actual ctx", "steps", "TPOT ms p50", "p99", "tok/s", "GB moved",
           "floor ms", "p50/floor", "fill s"});
  Json arr = Json::array();
  for (const auto& d : r) {
    t.row({std::to_string(d.batch), std::to_string(d.context), fmt("%.0f", d.context_mean),
           std::to_string(d.tpot_s.n), ms(d.tpot_s.p50), ms(d.tpot_s.p99),
           fmt("%.1f", d.batch / d.tpot_s.p50), fmt("%.2f", d.bytes.total() / 1e9), ms(d.floor_s),
           ratio(d.tpot_s.p50, d.floor_s), fmt("%.1f", d.fill_s)});
    arr.push_back(Json{{"batch", d.batch},
                       {"context", d.context},
                       {"context_mean", d.context_mean},
                       {"warmup", d.warmup},
                       {"logits_to_host", d.logits},
                       {"tpot_s", to_json(d.tpot_s)},
                       {"tok_per_s", d.batch / d.tpot_s.p50},
                       {"bytes", Json{{"weights", d.bytes.weights},
                                      {"kv", d.bytes.kv},
                                      {"gdn_state", d.bytes.gdn_state},
                                      {"activations", d.bytes.activations},
                                      {"total", d.bytes.total()}}},
                       {"floor_s", d.floor_s > 0 ? Json(d.floor_s) : Json(nullptr)},
                       {"ratio_p50", ratio_json(d.tpot_s.p50, d.floor_s)},
                       {"ratio_p99", ratio_json(d.tpot_s.p99, d.floor_s)},
                       {"fill_s", d.fill_s},
                       {"fill_tokens", d.fill_tokens}});
  }
  const bool logits = !r.empty() && r.front().logits;
  t.print(std::string("decode (TPOT = one step of one token per sequence, host clock, ") +
          (logits ? "step() with every row's logits copied to the host"
                  : "step_greedy: argmax where the logits are, on a GPU 4 bytes per row to the host") +
          "; floor = bytes / " +
          (c.valid ? tbs(c.read_bps) + " TB/s read ceiling)" : "no ceiling)"));
  doc_["decode"] = arr;
}

void Report::add_serve(const ServeResult& r) {
  Table t({"bucket", "requests", "TTFT ms p50", "p99", "TPOT ms p50", "p99", "tok/s", "weight"});
  Json arr = Json::array();
  for (const auto& b : r.buckets) {
    t.row({b.name, std::to_string(b.prompts.size()), ms(b.ttft_s.p50), ms(b.ttft_s.p99),
           ms(b.tpot_s.p50), ms(b.tpot_s.p99), fmt("%.2f", b.throughput),
           fmt("%.0f%%", 100 * b.weight)});
    arr.push_back(Json{{"bucket", b.name},
                       {"lo", b.lo},
                       {"hi", b.hi},
                       {"weight", b.weight},
                       {"prompts", b.prompts},
                       {"ttft_s", to_json(b.ttft_s)},
                       {"tpot_s", to_json(b.tpot_s)},
                       {"throughput_tok_per_s", b.throughput}});
  }
  t.row({"weighted", "", "", "", "", "", fmt("%.2f", r.weighted_throughput), ""});
  t.print("serve, concurrency 1, " + r.mode + ", " + std::to_string(r.output_tokens) +
          " output tokens, EOS ignored");
  doc_["serve"] = Json{{"mode", r.mode},
                       {"output_tokens", r.output_tokens},
                       {"buckets", arr},
                       {"weighted_throughput_tok_per_s", r.weighted_throughput}};
}

void Report::write(const std::string& path) const {
  std::ofstream f(path);
  DS_CHECK(f.good(), "bench: cannot write the JSON file ", path);
  f << doc_.dump(2) << "\n";
  DS_CHECK(f.good(), "bench: error while writing ", path);
}

}  // namespace ds::bench
