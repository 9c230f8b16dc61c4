"""Front-ends: how a forward becomes pieces the back half (``piecewise.capture``) captures and replays.

A front-end is built at the runner's first call and offers:
- ``name``: ``"dynamo"`` or ``"breakable"``;
- ``run(arguments)``: the forward on ``arguments`` for the call in ``state.call`` (``Phase.DIRECT``: the
  caller's tensors, no padding; ``PADDED``: staged buffers of ``call.size`` rows, no graphs; ``CAPTURE``: the
  same, recording this size's graphs; ``REPLAY``: this size's graphs replayed). Splitting ops see only
  ``call.num_tokens`` rows and write into static buffers whose padding rows are zero. Runners that recorded a
  graph for the size being captured go into ``state.captured_this_size`` (``release_outputs(size)`` then makes
  their pool tensors non-owning);
- ``release()``: drop every graph; ``graph_count()``: graphs held;
- ``mixing_hint()``: where the forward may combine token rows, for the padding check's message.
"""
