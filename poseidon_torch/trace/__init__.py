"""The bundled tracer: how much communication hid behind compute, per layer.

- :mod:`.recorder`: records spans on every rank during a window of iterations (``TraceConfig``,
  ``Recorder``) and writes Chrome trace files;
- :mod:`.spans`: the span record shared by all parts;
- :mod:`.files`: reading and writing Chrome Trace Event JSON;
- :mod:`.overlap`: interval arithmetic (HTA's overlap ratio);
- :mod:`.summary`: per-layer table and totals (no matplotlib);
- :mod:`.plot`: the timeline PNG (imports matplotlib);
- :mod:`.cli`: ``poseidon-trace`` / ``python -m poseidon_torch.trace``.
"""
from .cli import main
from .files import TraceFormatError, load_spans, merge_traces
from .recorder import Recorder, TraceConfig
from .spans import Span
from .summary import format_summary, summarize

__all__ = ["main", "TraceFormatError", "load_spans", "merge_traces", "Recorder", "TraceConfig", "Span",
           "format_summary", "summarize"]
