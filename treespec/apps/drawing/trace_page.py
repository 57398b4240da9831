"""A self-contained HTML page that steps through one prompt of a replay trace, several policies'
trees side by side at each position (`treespec draw --trace T --html PAGE`).

Contract
--------
`trace_page(trace, methods, prompt)` returns one HTML document with no external resource: the
data (per position, each method's tree as laid out by `treespec.apps.drawing.trees.tree_layout`, its
accepted path and the nodes no other method's tree holds: `treespec.apps.replay.views`) is one JSON
object in the page, and a short script draws it as SVG.  The page opens at ``start`` or at the
position its address names (``page.html#position=7``); buttons, a slider and the arrow keys step
through positions.  The same inputs give the same bytes.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Sequence

from treespec.apps.drawing.trees import tree_layout
from treespec.apps.replay.trace import Trace
from treespec.apps.replay.views import TreeView, check_position, views_at

__all__ = ["page_data", "trace_page"]


def _tree_data(view: TreeView, label: Callable[[int], str]) -> dict:
    """One tree as the page draws it: per node [x, depth, parent, label, score, accepted, only]."""
    pos, tree = tree_layout(view.tree), view.tree
    accepted = set(view.accepted)
    nodes = [[round(pos[i][0], 3), int(tree.depths[i]), int(p), label(int(t)),
              None if i == 0 else round(float(s), 3), i in accepted, i in view.only]
             for i, (t, p, s) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist()))]
    return {"method": view.method, "tau": view.tau, "nodes": nodes}


def page_data(trace: Trace, methods: Sequence[str], prompt: int, label: Callable[[int], str] | None = None) -> dict:
    """The page's JSON object: the prompt, its response tokens, and per position each method's tree."""
    label = label or str
    seq = trace.sequences[prompt].tolist()
    start = trace.prompt_len(prompt)
    cache: dict = {}  # one draft rebuilder per drafter for every position
    positions = [[_tree_data(v, label) for v in views_at(trace, methods, prompt, p, cache=cache)]
                 for p in range(trace.max_new_tokens)]
    return {"prompt_id": trace.meta["prompts"][prompt]["id"], "methods": list(methods),
            "prompt_tail": [label(t) for t in seq[max(0, start - 24):start]],
            "response": [label(t) for t in seq[start:start + trace.max_new_tokens]], "positions": positions}


def trace_page(trace: Trace, methods: Sequence[str], prompt: int, label: Callable[[int], str] | None = None,
               *, start: int = 0, title: str | None = None) -> str:
    """The HTML document (module docstring)."""
    check_position(trace, prompt, start)
    data = page_data(trace, methods, prompt, label)
    data["start"] = start
    payload = json.dumps(data, ensure_ascii=True, separators=(",", ":")).replace("</", "<\\/")
    heading = title or f"{', '.join(methods)} on prompt {prompt} ({data['prompt_id']})"
    return _TEMPLATE.replace("__TITLE__", html.escape(heading)).replace("__DATA__", payload)


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
body { font-family: Helvetica, Arial, sans-serif; margin: 1.2em; color: #263238; }
h1 { font-size: 1.15em; }
#controls { display: flex; gap: 0.6em; align-items: center; margin-bottom: 0.6em; }
#slider { width: 24em; }
#context { font-family: monospace; white-space: pre-wrap; background: #f5f5f5; padding: 0.5em; font-size: 0.85em; }
#context .done { color: #263238; } #context .prompt { color: #90a4ae; }
#context .root { background: #fff59d; } #context .next { background: #c8e6c9; }
#trees { display: flex; gap: 1.5em; align-items: flex-start; flex-wrap: wrap; }
figure { margin: 0; border: 1px solid #cfd8dc; padding: 0.4em; }
figcaption { font-size: 0.9em; margin-bottom: 0.3em; }
.legend { font-size: 0.8em; color: #546e7a; margin: 0.4em 0; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; vertical-align: middle; margin: 0 0.2em 0 0.8em; }
</style>
</head>
<body>
<h1>__TITLE__</h1>
<div id="controls">
  <button id="prev" type="button">&#9664; previous</button>
  <input id="slider" type="range" min="0" step="1">
  <button id="next" type="button">next &#9654;</button>
  <span id="where"></span>
</div>
<div class="legend">
  <span class="swatch" style="background:#2e7d32"></span>accepted path (the target's greedy tokens)
  <span class="swatch" style="border:2px dashed #ef6c00"></span>in this tree only
  <span class="swatch" style="background:#fff59d"></span>the round's root
  <span class="swatch" style="background:#c8e6c9"></span>the tokens that follow
</div>
<p id="context"></p>
<div id="trees"></div>
<script>
const DATA = __DATA__;
const SVG = "http://www.w3.org/2000/svg";
const slider = document.getElementById("slider");
slider.max = DATA.positions.length - 1;

function el(name, attrs, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function drawTree(tree) {
  const fig = document.createElement("figure");
  const only = tree.nodes.filter(n => n[6]).length;
  const cap = document.createElement("figcaption");
  cap.textContent = tree.method + ": tau " + tree.tau + ", " + (tree.nodes.length - 1) + " draft nodes, "
    + only + " in this tree only";
  fig.appendChild(cap);
  const dx = 64, dy = 56, w = 52, h = 34;
  const width = (Math.max(...tree.nodes.map(n => n[0])) + 1) * dx + 10;
  const height = (Math.max(...tree.nodes.map(n => n[1])) + 1) * dy + 10;
  const svg = el("svg", {width: width, height: height, viewBox: "0 0 " + width + " " + height, class: "tree"});
  const at = n => [5 + n[0] * dx + dx / 2, 5 + n[1] * dy + h / 2];
  tree.nodes.forEach(n => {
    if (n[2] < 0) return;
    const [x1, y1] = at(tree.nodes[n[2]]), [x2, y2] = at(n);
    const on = n[5] && tree.nodes[n[2]][5];
    svg.appendChild(el("line", {x1: x1, y1: y1, x2: x2, y2: y2, stroke: on ? "#2e7d32" : "#90a4ae",
                                "stroke-width": on ? 3 : 1}));
  });
  tree.nodes.forEach((n, i) => {
    const [x, y] = at(n);
    const g = el("g", {class: "node", "data-node": i});
    g.appendChild(el("rect", {x: x - w / 2, y: y - h / 2, width: w, height: h, rx: 5,
      fill: n[5] ? "#2e7d32" : "#eceff1", stroke: n[6] ? "#ef6c00" : "none",
      "stroke-width": n[6] ? 2.5 : 0, "stroke-dasharray": n[6] ? "5,3" : "none"}));
    g.appendChild(el("text", {x: x, y: n[4] === null ? y + 4 : y - 2, "text-anchor": "middle", "font-size": 11,
      fill: n[5] ? "#ffffff" : "#263238"}, n[3]));
    if (n[4] !== null) g.appendChild(el("text", {x: x, y: y + 12, "text-anchor": "middle", "font-size": 9,
      fill: n[5] ? "#ffffff" : "#546e7a"}, n[4].toFixed(2)));
    g.appendChild(el("title", {}, n[3] + (n[4] === null ? " (root)" : " log q " + n[4])));
    svg.appendChild(g);
  });
  fig.appendChild(svg);
  return fig;
}

function span(cls, text) {
  const s = document.createElement("span");
  s.className = cls;
  s.textContent = text;
  return s;
}

function show(position) {
  position = Math.max(0, Math.min(DATA.positions.length - 1, position));
  slider.value = position;
  document.getElementById("where").textContent = "position " + position + " of " + DATA.positions.length
    + " (response tokens committed before the round)";
  const context = document.getElementById("context");
  const first = position === 0;  // the first round's root is the prompt's last token
  context.replaceChildren(span("prompt", DATA.prompt_tail.slice(0, first ? -1 : undefined).join("")));
  context.appendChild(span("done", DATA.response.slice(0, Math.max(0, position - 1)).join("")));
  context.appendChild(span("root", first ? DATA.prompt_tail[DATA.prompt_tail.length - 1] : DATA.response[position - 1]));
  context.appendChild(span("next", DATA.response.slice(position, position + 8).join("")));
  const trees = document.getElementById("trees");
  trees.replaceChildren(...DATA.positions[position].map(drawTree));
  document.body.dataset.position = position;
  history.replaceState(null, "", "#position=" + position);
}

function fromAddress() {
  const match = /position=(\\d+)/.exec(location.hash);
  return match ? parseInt(match[1], 10) : DATA.start;
}

document.getElementById("prev").onclick = () => show(Number(slider.value) - 1);
document.getElementById("next").onclick = () => show(Number(slider.value) + 1);
slider.oninput = () => show(Number(slider.value));
document.addEventListener("keydown", e => {
  if (e.key === "ArrowLeft") show(Number(slider.value) - 1);
  if (e.key === "ArrowRight") show(Number(slider.value) + 1);
});
show(fromAddress());
</script>
</body>
</html>
"""
