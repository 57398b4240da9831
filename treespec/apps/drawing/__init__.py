"""Drawing: pictures of trees for docs and debugging.

* `trees` -- one tree as a matplotlib figure, DOT or Mermaid, and trees side by side;
* `trace_page` -- the HTML page of a recorded trace's trees, round by round.
"""
