// SPDX-License-Identifier: Apache-2.0
// budget_curves(): the ratio sweep's accuracy-vs-budget curves, one per method.
#include <algorithm>
#include <cmath>
#include <map>

#include "kvcache/error.h"
#include "kvcache/spec.h"
#include "kvcache/study/arm.h"
#include "kvcache/study/report.h"
#include "study/report_format.h"

namespace kvcache::study {

std::vector<BudgetCurve> budget_curves(const Summary& s) {
  struct Point {
    double value;
    std::string label;
    const ArmSummary* arm;
  };
  // (method, budget kind) -> points, in plan order of the method's first arm.
  std::vector<std::pair<std::string, Budget::Kind>> order;
  std::map<std::pair<std::string, Budget::Kind>, std::vector<Point>> groups;
  for (const auto& a : s.arms) {
    if (a.tasks == 0) continue;
    Arm arm;
    try {
      arm = parse_arm(a.arm);
    } catch (const InvalidArgument&) {
      continue;  // not a scheme+policy spec: no curve
    }
    const auto [head, budget] = split_budget(arm.policy);
    if (budget.kind == Budget::Kind::kNone) continue;
    const auto key = std::make_pair(arm.scheme + "+" + head, budget.kind);
    if (!groups.count(key)) order.push_back(key);
    groups[key].push_back({budget.value, budget.to_string(), &a});
  }
  const ArmSummary* control = nullptr;
  for (const auto& a : s.arms) {
    if (a.is_control && a.tasks > 0) control = &a;
  }
  std::vector<BudgetCurve> out;
  for (const auto& key : order) {
    auto points = groups.at(key);
    if (points.size() < 2) continue;
    std::stable_sort(points.begin(), points.end(), [](const Point& x, const Point& y) { return x.value < y.value; });
    BudgetCurve c;
    c.method = key.first;
    for (const auto& p : points) {
      c.budgets.push_back(p.label);
      c.budget_values.push_back(p.value);
      c.arms.push_back(p.arm->arm);
      c.accuracy.push_back(p.arm->accuracy);
    }
    for (const auto& f : s.families) {
      auto& v = c.family_accuracy[f];
      for (const auto& p : points) {
        const auto it = p.arm->family_accuracy.find(f);
        v.push_back(it == p.arm->family_accuracy.end() ? report_format::kNaN : it->second);
      }
    }
    for (int d : s.depths) {
      auto& v = c.depth_accuracy[d];
      for (const auto& p : points) {
        const auto it = p.arm->depth_accuracy.find(d);
        v.push_back(it == p.arm->depth_accuracy.end() ? report_format::kNaN : it->second);
      }
    }
    if (control != nullptr) {
      for (size_t i = 0; i < points.size(); ++i) {
        const ArmSummary& a = *points[i].arm;
        if (a.tasks == control->tasks && a.passed >= control->passed - 1) {
          c.smallest_within_one_task = static_cast<int>(i);
          break;
        }
      }
    }
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace kvcache::study
