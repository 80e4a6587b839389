// Package shm is the default device backend of kvactors: an engine's device
// memory is one or more POSIX shared-memory objects (files under Config.Dir,
// /dev/shm by default) that the engine creates and kvactors maps read/write.
//
// It owns three things:
//   - the attach side of the shm segment convention (PROTOCOL.md, EngineSpec
//     "segments"): a segment's name is a plain file name, opened relative to
//     the directory without following a symlink, and must be a non-empty
//     regular file; anything else is refused with backend.ErrBadSegment;
//   - which bytes of a segment are mapped: Attach maps whole objects,
//     AttachSpans (the node's) only the pages of the span its regions use,
//     so a sparse object of terabytes costs the node its regions' pages of
//     address space, not terabytes;
//   - the host pool's arena (one anonymous private mapping) and the copies
//     between the two, bounds-checked all-or-nothing before any byte moves;
//   - the engine side of the same convention (Create, Segment), used by tests,
//     the simulated engine and the demo, so both sides share one name rule.
//
// An engine must not shrink an object while it is attached: a copy touching
// a page beyond the new end of file would fault. Copy turns that fault into
// an error wrapping ErrFault instead of crashing the process.
package shm
