package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"

	clusterdemo "github.com/kvactors/kvactors/cluster/demo"
)

// runClusterDemo is `kvactors demo --cluster N` (package cluster/demo).
func runClusterDemo(ctx context.Context, o demoOptions, log *slog.Logger, stdout, stderr io.Writer) int {
	if o.cluster < 2 {
		fmt.Fprintln(stderr, "kvactors demo: --cluster wants at least 2 nodes (see kvactors demo --help)")
		return exitUsage
	}
	opts := clusterdemo.Options{Nodes: o.cluster, Seed: o.seed, Log: log}
	if o.quick {
		opts.Prefixes, opts.Chunks = 2, 4
	}
	if _, err := clusterdemo.Run(ctx, opts, stdout); err != nil {
		if ctx.Err() != nil { // Ctrl-C: whatever failed, it failed because the run was stopped
			fmt.Fprintf(stderr, "kvactors demo --cluster: %v (%v)\n", errInterrupted, err)
			return exitInterrupted
		}
		fmt.Fprintln(stderr, "kvactors demo --cluster:", err)
		if isConfigError(err) {
			return exitUsage
		}
		return exitFailure
	}
	return exitOK
}
