package main

import (
	"log/slog"
	"os"
	"runtime/debug"
)

// Default GC setting of serve, used when GOGC / GOMEMLIMIT are unset (they
// override it; docs/BENCHMARKS.md "GC setting"). The pool arena is mmapped
// outside the Go heap, so the heap holds only request state and messages:
// GOGC 400 spends less node CPU per event than 100 on the store-heavy mix,
// and the soft limit makes the collector run more often instead of letting
// a burst grow the heap past it. The limit is the Go share of issue 14's
// RSS budget (pool + 256 MiB): the binary's mapped text (~25 MiB) and the
// engines' segment pages a copy touched count in RSS too.
const (
	serveGCPercent   = 400
	serveMemoryLimit = 208 << 20
)

func setGC(log *slog.Logger) {
	if _, ok := os.LookupEnv("GOGC"); !ok {
		debug.SetGCPercent(serveGCPercent)
		log.Debug("gc percent", "value", serveGCPercent)
	}
	if _, ok := os.LookupEnv("GOMEMLIMIT"); !ok {
		debug.SetMemoryLimit(serveMemoryLimit)
		log.Debug("gc memory limit", "bytes", serveMemoryLimit)
	}
}
