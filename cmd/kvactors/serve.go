package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"

	"github.com/kvactors/kvactors/node"
	"github.com/kvactors/kvactors/tracing"
)

func serve(args []string) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	var cfg node.Config
	if _, err := cfg.BindFlags(fs); err != nil {
		fmt.Fprintln(os.Stderr, "kvactors serve:", err)
		return 2
	}
	logLevel := fs.String("log-level", envOr("KVACTORS_LOG_LEVEL", "info"), "log level: debug, info, warn, error")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log, err := newLogger(*logLevel)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvactors serve:", err)
		return 2
	}
	setGC(log)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	tp, shutdownTracing, err := tracing.Init(ctx, tracing.Options{})
	if err != nil {
		log.Error("tracing", "err", err)
		return 1
	}
	defer func() { _ = shutdownTracing(context.Background()) }()
	cfg.Log, cfg.Tracer = log, tp
	n, err := node.Start(ctx, cfg)
	if err != nil {
		log.Error("start", "err", err)
		return 1
	}
	fmt.Printf("kvactors serving: nats %s, prefix %q, admin http %s\n", n.NATSURL(), cfg.Prefix, n.HTTPAddr())
	<-ctx.Done()
	log.Info("shutting down")
	if err := n.Close(context.Background()); err != nil {
		// ErrUndelivered names how many releases were left owed: an engine
		// waiting for them learns of it through the node's new boot.
		log.Error("shutdown", "err", err)
		return 1
	}
	return 0
}

// Default GC setting of serve, used when GOGC / GOMEMLIMIT are unset (they
// override it; docs/BENCHMARKS.md "GC setting"). The pool arena is mmapped
// outside the Go heap, so the heap holds only request state and messages:
// GOGC 400 spends ~15% less node CPU per event than 100 on the store-heavy
// mix, and the soft limit makes the collector run more often instead of
// letting a burst grow the heap past it.
const (
	serveGCPercent   = 400
	serveMemoryLimit = 256 << 20
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

func flagsTable(args []string) int {
	var cfg node.Config
	flags, _ := cfg.BindFlags(flag.NewFlagSet("serve", flag.ContinueOnError))
	node.WriteFlagTable(os.Stdout, flags)
	return 0
}

func newLogger(level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log level %q: %w", level, err)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l})), nil
}

func envOr(key, def string) string {
	if v, ok := os.LookupEnv(key); ok {
		return v
	}
	return def
}
