# SPDX-License-Identifier: Apache-2.0
"""tools/plot_results.py on a synthetic summary.json."""
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import plot_results  # noqa: E402


def synthetic_summary():
    def arm(name, acc, ratio, ppl, depth, control=False):
        return {"arm": name, "is_control": control, "accuracy": acc, "memory_ratio": ratio,
                "ppl_single": ppl, "ppl_stream": None if ppl is None else ppl + 0.5,
                "depth_accuracy": depth}
    return {
        "model": "synthetic", "control": "fp32+full", "depths": [5, 35, 65, 95],
        "arms": [
            arm("fp32+full", 0.95, 1.0, 10.0, {"5": 1.0, "35": 1.0, "65": 1.0, "95": 1.0}, True),
            arm("int8+full", 0.95, 0.27, 10.01, {"5": 1.0, "35": 1.0, "65": 1.0, "95": 1.0}),
            arm("int4+full", 0.90, 0.14, 10.3, {"5": 0.9, "35": 1.0, "65": 1.0, "95": 1.0}),
            arm("fp32+h2o@50%", 0.70, 0.50, 11.0, {"5": 0.2, "35": 0.5}),
            arm("int2+full", 0.30, 0.08, None, {}),
            arm("broken", None, None, None, {}),
        ],
    }


class ParetoFrontTest(unittest.TestCase):
    def test_hand_checked_front(self):
        pts = [(1.0, 95), (0.27, 95), (0.14, 90), (0.5, 70), (0.08, 30), (0.27, 80)]
        # (1.0, 95) is dominated by (0.27, 95); (0.5, 70) by (0.27, 95); (0.27, 80) by (0.27, 95)
        self.assertEqual(plot_results.pareto_front(pts), [4, 2, 1])

    def test_ties_keep_both(self):
        self.assertEqual(plot_results.pareto_front([(1, 1), (1, 1)]), [0, 1])
        self.assertEqual(plot_results.pareto_front([]), [])


class PlotTest(unittest.TestCase):
    def test_writes_three_pngs(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "summary.json")
            with open(path, "w") as f:
                json.dump(synthetic_summary(), f)
            out = plot_results.make_plots(path)
            self.assertEqual([os.path.basename(p) for p in out], ["pareto.png", "depth_heatmap.png", "ppl_accuracy.png"])
            for p in out:
                self.assertTrue(p.startswith(os.path.join(d, "plots")))
                with open(p, "rb") as f:
                    self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
                self.assertGreater(os.path.getsize(p), 2000)
            self.assertEqual(plot_results.main([path, "--out", os.path.join(d, "o")]), 0)

    def test_lengths_add_three_pngs(self):
        """Two prompt lengths (the long suite): accuracy vs length, a front per length and the depth x
        length grid; one length draws none of them."""
        s = synthetic_summary()
        s["lengths"] = [4096, 16384]
        for a in s["arms"]:
            acc, ratio = a["accuracy"], a["memory_ratio"]
            a["by_length"] = {} if acc is None else {
                "4096": {"accuracy": acc, "memory_ratio": ratio, "depth_accuracy": a["depth_accuracy"]},
                "16384": {"accuracy": acc * 0.8, "memory_ratio": ratio, "depth_accuracy": {"5": 0.5}}}
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "summary.json")
            with open(path, "w") as f:
                json.dump(s, f)
            out = plot_results.make_plots(path)
            self.assertEqual([os.path.basename(p) for p in out[3:]],
                             ["length_accuracy.png", "length_pareto.png", "length_depth.png"])
            for p in out[3:]:
                with open(p, "rb") as f:
                    self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
            s["lengths"] = [4096]
            with open(path, "w") as f:
                json.dump(s, f)
            self.assertEqual(len(plot_results.make_plots(path)), 3)

    def test_budget_curves_add_three_pngs(self):
        s = synthetic_summary()
        s["families"] = ["needle", "summary"]
        s["arms"][0]["family_accuracy"] = {"needle": 1.0, "summary": 0.9}
        s["curves"] = [
            {"method": "fp32+h2o", "budgets": ["@25%", "@50%", "@87.5%"], "budget_values": [0.25, 0.5, 0.875],
             "arms": ["fp32+h2o@25%", "fp32+h2o@50%", "fp32+h2o@87.5%"], "accuracy": [0.2, 0.7, None],
             "family_accuracy": {"needle": [0.1, 0.5, 0.9], "summary": [0.3, 0.9, 1.0]},
             "depth_accuracy": {"5": [0.0, 0.2, 1.0], "35": [0.5, 0.5, 1.0]},
             "smallest_within_one_task": "@87.5%"},
            {"method": "fp32+snapkv", "budgets": ["@64", "@128"], "budget_values": [64, 128],
             "arms": ["fp32+snapkv@64", "fp32+snapkv@128"], "accuracy": [0.5, 0.9],
             "family_accuracy": {}, "depth_accuracy": {}, "smallest_within_one_task": None},
        ]
        # Percent budgets plot as percentages, token budgets as tokens; a missing value is left out.
        self.assertEqual(plot_results.curve_points(s["curves"][0], s["curves"][0]["accuracy"]),
                         [(25.0, 20.0), (50.0, 70.0)])
        self.assertEqual(plot_results.curve_points(s["curves"][1], s["curves"][1]["accuracy"]),
                         [(64.0, 50.0), (128.0, 90.0)])
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "summary.json")
            with open(path, "w") as f:
                json.dump(s, f)
            out = plot_results.make_plots(path)
            self.assertEqual([os.path.basename(p) for p in out],
                             ["pareto.png", "depth_heatmap.png", "ppl_accuracy.png", "budget_accuracy.png",
                              "budget_family.png", "budget_depth.png"])
            for p in out[3:]:
                with open(p, "rb") as f:
                    self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
                self.assertGreater(os.path.getsize(p), 2000)

    def test_agnostic_list_adds_query_mode_plots(self):
        s = synthetic_summary()
        curve = {"method": "fp32+snapkv", "budgets": ["@25%", "@50%"], "budget_values": [0.25, 0.5],
                 "arms": ["fp32+snapkv@25%", "fp32+snapkv@50%"], "accuracy": [0.4, 0.6],
                 "family_accuracy": {}, "depth_accuracy": {}, "smallest_within_one_task": None}
        s["agnostic"] = {"control": "fp32+full", "has_control": True, "families": [], "depths": [],
                         "arms": [{"arm": "fp32+h2o@50%", "accuracy": 0.25},
                                  {"arm": "fp32+full", "accuracy": 0.95, "is_control": True},
                                  {"arm": "agnostic-only", "accuracy": 0.5},
                                  {"arm": "int4+full", "accuracy": None}],
                         "curves": [curve], "notes": []}
        # Arms with an accuracy in both lists, in the agnostic list's order, as percentages.
        self.assertEqual(plot_results.mode_pairs(s), [("fp32+h2o@50%", 70.0, 25.0), ("fp32+full", 95.0, 95.0)])
        self.assertEqual(plot_results.mode_pairs(synthetic_summary()), [])
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "summary.json")
            with open(path, "w") as f:
                json.dump(s, f)
            out = plot_results.make_plots(path)
            self.assertEqual([os.path.basename(p) for p in out[3:]], ["query_modes.png", "budget_accuracy_agnostic.png"])
            for p in out[3:]:
                with open(p, "rb") as f:
                    self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
                self.assertGreater(os.path.getsize(p), 2000)

    def test_bad_input_is_an_error(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "x.json")
            with open(path, "w") as f:
                json.dump({"model": "m"}, f)
            self.assertEqual(plot_results.main([path]), 1)
            self.assertEqual(plot_results.main([os.path.join(d, "missing.json")]), 1)


if __name__ == "__main__":
    unittest.main()
