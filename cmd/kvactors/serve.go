package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/kvactors/kvactors/node"
	"github.com/kvactors/kvactors/tracing"
)

// runServe is `kvactors serve`: settings from flags, KVACTORS_* and
// --config (node.Flags), then a node until SIGINT or SIGTERM.
func runServe(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	var cfg node.Config
	flags := cfg.BindFlags(fs)
	if code := parseExit("serve", flags.Parse(args), fs, stdout, stderr,
		"Each setting comes from its flag, else its KVACTORS_<FLAG> variable, else the --config file, else the",
		"default (docs/CONFIG.md). NATS secrets: NATS_USER, NATS_PASSWORD, NATS_TOKEN (environment only).",
		"Tracing: the standard OTEL_* variables (docs/OBSERVABILITY.md)."); code >= 0 {
		return code
	}
	err := cfg.Validate()
	if err == nil {
		err = cfg.CheckFiles() // a NATS secret file that cannot be read: exit 2, as for a bad flag
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvactors serve: %v (see kvactors serve --help)\n", err)
		return exitUsage
	}
	log, err := cfg.NewLogger(stderr)
	if err != nil { // Validate checked it; kept for the error path's sake
		fmt.Fprintln(stderr, "kvactors serve:", err)
		return exitUsage
	}
	for _, w := range flags.Warnings {
		log.Warn(w)
	}
	for _, name := range flags.UnknownEnv(os.Environ()) {
		log.Warn(name + " is set but names no serve flag: ignored (misspelled? see kvactors serve --help)")
	}
	setGC(log)
	ctx, stop := signalContext(func(s os.Signal) {
		log.Error("second signal: exiting now, the shutdown unfinished", "signal", signalName(s))
	})
	defer stop()
	tp, shutdownTracing, err := tracing.Init(ctx, tracing.Options{})
	if errors.Is(err, tracing.ErrConfig) {
		// A bad OTEL_* value is configuration like a bad flag: exit 2, which
		// systemd does not restart (RestartPreventExitStatus=2).
		fmt.Fprintf(stderr, "kvactors serve: %v (see kvactors serve --help)\n", err)
		return exitUsage
	}
	if err != nil {
		log.Error("tracing", "err", err)
		return exitFailure
	}
	tracing.LogErrors(log)
	// Bounded (tracing.DefaultShutdownTimeout): spans queued for a
	// collector that cannot be reached must not hold the exit up.
	defer func() { _ = shutdownTracing(context.Background()) }()
	cfg.Log, cfg.Tracer = log, tp
	n, err := node.Start(ctx, cfg)
	switch {
	case err != nil && ctx.Err() != nil:
		log.Info("stopped before the node was up", "err", err)
		return exitOK
	case errors.Is(err, node.ErrConfig):
		log.Error("start", "err", err)
		return exitUsage
	case err != nil:
		log.Error("start", "err", err)
		return exitFailure
	}
	fmt.Fprintf(stdout, "kvactors serving: nats %s, prefix %q, admin http %s\n", n.NATSURL(), cfg.Prefix, n.HTTPAddr())
	<-ctx.Done()
	log.Info("shutting down")
	if err := n.Close(context.Background()); err != nil {
		// ErrUndelivered names how many releases were left owed: an engine
		// waiting for them learns of it through the node's new boot.
		log.Error("shutdown", "err", err)
		return exitFailure
	}
	return exitOK
}

// flagsTable is `kvactors flags`: the serve flags as the Markdown table of
// docs/CONFIG.md, with the built-in defaults (never the environment's).
func flagsTable(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("flags", flag.ContinueOnError)
	if code := parseExit("flags", parseFlags(fs, args), fs, stdout, stderr); code >= 0 {
		return code
	}
	var cfg node.Config
	node.WriteFlagTable(stdout, cfg.BindFlags(flag.NewFlagSet("serve", flag.ContinueOnError)).List)
	return exitOK
}
