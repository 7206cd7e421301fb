"""The layer every op builds on, which knows no op: which arch a device is (`device`), the one
config selector with the caches it clears (`select`), and the autograd hook an op's backward
registers with (`autograd`). Render, compile, knobs and the arch table (autossd.render,
autossd.compile, autossd.knobs, autossd.arch) and the launch cache (autossd.ops.common) know
no op either; an op declares itself in autossd.ops and these take it by name."""
