package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/schollz/progressbar/v3"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/node"
	"github.com/kvactors/kvactors/sim"
	"github.com/kvactors/kvactors/tracing"
)

// demoOptions are the demo's flags.
type demoOptions struct {
	engines   int
	requests  int
	spread    time.Duration
	step      time.Duration
	natsURL   string
	shmDir    string
	poolBytes string
	traceFile string
	otlp      bool
	seed      uint64
	quick     bool
	logLevel  string
	diskDir   string
	diskBytes string
	disk      int64 // diskBytes parsed
	// minCoverage is the share of checked keys that must be found and
	// matched for the verdict to mean much; below it the demo warns, or
	// fails with requireCoverage.
	minCoverage     float64
	requireCoverage bool
	pool            int64 // poolBytes parsed
	cluster         int   // >0: the cluster demo (cluster/demo)
	// engineFault, set by tests only, changes an engine's config: a fault
	// injected into one engine of a real run.
	engineFault func(*sim.Config)
}

// errInterrupted ends a demo stopped by Ctrl-C or SIGTERM.
var errInterrupted = errors.New("interrupted")

// runDemo is `kvactors demo`: a node and simulated engines in one process,
// a progress bar while they run, then the summary and the integrity
// verdict. Exit status: 0 when every check passed, 1 when one failed or
// the run broke, 2 for bad flags, 130 when interrupted (and at once, 130 or
// 143, on a second Ctrl-C or SIGTERM while it stops).
func runDemo(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signalContext(func(s os.Signal) {
		fmt.Fprintf(stderr, "\nkvactors demo: second %s: exiting now, without waiting for the node to stop\n", signalName(s))
	})
	defer stop()
	return runDemoCtx(ctx, args, stdout, stderr)
}

func runDemoCtx(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, code := parseDemoFlags(args, stdout, stderr)
	if code >= 0 {
		return code
	}
	log, err := newDemoLogger(o.logLevel, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "kvactors demo: %v (see kvactors demo --help)\n", err)
		return exitUsage
	}
	if o.cluster > 0 {
		return runClusterDemo(ctx, o, log, stdout, stderr)
	}
	return demoExit(ctx, o, log, stdout, stderr)
}

// demoExit runs the single-node demo and prints its error last.
func demoExit(ctx context.Context, o demoOptions, log *slog.Logger, stdout, stderr io.Writer) int {
	err := runDemoWith(ctx, o, log, stdout, stderr)
	switch {
	case errors.Is(err, errInterrupted):
		fmt.Fprintln(stderr, "kvactors demo:", err)
		return exitInterrupted
	case isConfigError(err):
		fmt.Fprintf(stderr, "kvactors demo: %v (see kvactors demo --help)\n", err)
		return exitUsage
	case err != nil:
		fmt.Fprintln(stderr, "kvactors demo:", err)
		return exitFailure
	}
	return exitOK
}

// isConfigError: err is configuration as a bad flag is (a node setting, an
// OTEL_* value): exit 2 for every command alike (docs/OPERATIONS.md).
func isConfigError(err error) bool {
	return errors.Is(err, node.ErrConfig) || errors.Is(err, tracing.ErrConfig)
}

func parseDemoFlags(args []string, stdout, stderr io.Writer) (demoOptions, int) {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	var o demoOptions
	fs.IntVar(&o.engines, "engines", 2, "simulated engines, sharing one node and one seed (so their prefixes deduplicate)")
	fs.IntVar(&o.requests, "requests", 400, "requests in all, split across the engines")
	fs.DurationVar(&o.spread, "spread", 30*time.Second, "requests arrive evenly over this long")
	fs.DurationVar(&o.step, "step", 10*time.Millisecond, "scheduler step of each engine")
	fs.StringVar(&o.natsURL, "nats", "", "NATS URL to use instead of an embedded server")
	fs.StringVar(&o.shmDir, "shm-dir", defaultShmDir(), "where engines create their shm segments")
	fs.StringVar(&o.poolBytes, "pool-bytes", node.FormatBytes(node.DefaultConfig().PoolBytes), "host pool size")
	fs.StringVar(&o.traceFile, "trace-file", "", "write the node's spans to this file (console exporter JSON, one span per object)")
	fs.BoolVar(&o.otlp, "otlp", false, "also export spans by OTLP (OTEL_EXPORTER_OTLP_ENDPOINT, e.g. a local Jaeger)")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the token streams, lengths and fates")
	fs.BoolVar(&o.quick, "quick", false, "a run of about 5 seconds: fewer, shorter requests")
	fs.StringVar(&o.logLevel, "log-level", "error", "log level of the node and engines: debug, info, warn, error, off")
	fs.StringVar(&o.diskDir, "disk-dir", "", "give the node a disk tier here (try a small --pool-bytes: evicted chunks are loaded back from disk)")
	fs.StringVar(&o.diskBytes, "disk-bytes", "4GiB", "the disk tier's budget, with --disk-dir")
	fs.Float64Var(&o.minCoverage, "min-coverage", 0.5, "warn when fewer of the checked keys than this share were still in the pool to compare")
	fs.BoolVar(&o.requireCoverage, "require-coverage", false, "fail (exit 1) instead of warning below --min-coverage")
	fs.IntVar(&o.cluster, "cluster", 0, "run N nodes on an N-server NATS cluster instead (cross-node hits, integrity of every remote byte); "+
		"takes only --quick, --seed and --log-level besides")
	if code := parseExit("demo", parseFlags(fs, args), fs, stdout, stderr); code >= 0 {
		return o, code
	}
	bad := func(format string, a ...any) (demoOptions, int) {
		fmt.Fprintf(stderr, "kvactors demo: "+format+" (see kvactors demo --help)\n", a...)
		return o, exitUsage
	}
	var err error
	if o.pool, err = node.ParseBytes(o.poolBytes); err != nil || o.pool == 0 {
		return bad("--pool-bytes %q: want a size > 0 such as 64MiB or 1G", o.poolBytes)
	}
	if o.diskDir != "" {
		if o.disk, err = node.ParseBytes(o.diskBytes); err != nil || o.disk == 0 {
			return bad("--disk-bytes %q: want a size > 0 such as 4GiB", o.diskBytes)
		}
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if o.cluster > 0 {
		// cluster/demo has its own engines, pool and shm dir: any other flag
		// would do nothing.
		for _, f := range slices.Sorted(maps.Keys(set)) {
			if !clusterDemoFlags[f] {
				return bad("--%s does nothing with --cluster (it takes --quick, --seed and --log-level)", f)
			}
		}
	}
	if o.quick {
		// Explicit flags still win over --quick's defaults.
		if !set["requests"] {
			o.requests = 60
		}
		if !set["spread"] {
			o.spread = 4 * time.Second
		}
		if !set["step"] {
			o.step = 5 * time.Millisecond
		}
	}
	switch {
	case o.engines < 1 || o.requests < o.engines:
		return bad("want at least one engine and one request per engine (got %d, %d)", o.engines, o.requests)
	case o.spread <= 0 || o.step <= 0:
		return bad("--spread and --step must be > 0")
	case o.minCoverage < 0 || o.minCoverage > 1:
		return bad("--min-coverage %v: want 0..1", o.minCoverage)
	}
	return o, -1
}

// clusterDemoFlags are the demo's flags that `demo --cluster` uses.
var clusterDemoFlags = map[string]bool{"cluster": true, "quick": true, "seed": true, "log-level": true}

// defaultShmDir is /dev/shm where it can be written (the real thing), else
// the temp dir (the shm backend works on any directory).
func defaultShmDir() string {
	dir := node.DefaultConfig().ShmDir
	if f, err := os.CreateTemp(dir, "kvactors-probe-"); err == nil {
		_ = f.Close()
		_ = os.Remove(f.Name())
		return dir
	}
	return os.TempDir()
}

func newDemoLogger(level string, w io.Writer) (*slog.Logger, error) {
	if level == "off" {
		return slog.New(slog.DiscardHandler), nil
	}
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log level %q: %w", level, err)
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l})), nil
}

func runDemoWith(ctx context.Context, o demoOptions, log *slog.Logger, stdout, stderr io.Writer) (err error) {
	tp, shutdownTracing, tracingOn, err := demoTracing(ctx, o, stderr)
	if err != nil {
		return err
	}
	tracing.LogErrors(log)
	defer func() { err = errors.Join(err, shutdownTracing()) }()

	reg := prometheus.NewRegistry()
	n, err := node.Start(ctx, node.Config{NATSURL: o.natsURL, NATSPort: -1, ShmDir: o.shmDir, PoolBytes: o.pool,
		HTTPAddr: node.HTTPOff, Log: log, Tracer: tp, Registry: reg, DiskDir: o.diskDir, DiskBytes: o.disk})
	if err != nil {
		return fmt.Errorf("start the node: %w", err)
	}
	defer func() { err = errors.Join(err, n.Close(context.Background())) }()
	fmt.Fprintf(stderr, "kvactors demo: node on %s, %d engines, %d requests, pool %s, shm in %s\n",
		n.NATSURL(), o.engines, o.requests, o.poolBytes, o.shmDir)

	broke := false // the run ended early: set before the bar's Exit, which completes it too
	bar := progressbar.NewOptions(o.requests, progressbar.OptionSetWriter(stderr),
		progressbar.OptionSetDescription("requests"), progressbar.OptionShowCount(),
		progressbar.OptionSetElapsedTime(true), progressbar.OptionThrottle(100*time.Millisecond),
		progressbar.OptionOnCompletion(func() {
			if ctx.Err() == nil && !broke {
				fmt.Fprintln(stderr, "\nchecking every stored chunk byte for byte…")
			}
		}))
	cfgs := demoConfigs(o, log, func() { _ = bar.Add(1) })
	if tracingOn {
		// The engines' step spans become the parents of the node's spans.
		for i := range cfgs {
			cfgs[i].Tracer = tp
		}
	}
	reps, runErr := runEngines(ctx, n.NATSURL(), cfgs)
	interrupted := ctx.Err() != nil
	if interrupted || runErr != nil {
		broke = true
		_ = bar.Exit() // not Finish: the bar stays where the run stopped
		fmt.Fprintln(stderr)
	} else {
		_ = bar.Finish()
	}
	// The summary is worth printing even for a run that broke off: it says
	// how far it got.
	stats, err := sim.GatherNodeStats(reg)
	if err != nil {
		return errors.Join(runErr, err)
	}
	var serving time.Duration
	for _, r := range reps {
		serving = max(serving, r.Serving)
	}
	fmt.Fprintln(stdout)
	sim.WriteSummary(stdout, reps, stats, serving)
	if d := n.Disk(); d != nil {
		st := d.Stats()
		fmt.Fprintf(stdout, "disk tier: %d chunks written (%d bytes), %d loaded back from disk (hits), %d evicted, %d on disk now\n",
			st.Writes, st.WriteBytes, st.Hits, st.Evictions, st.Chunks)
	}
	if interrupted {
		finished := 0
		for _, r := range reps {
			finished += r.Finished + r.AbortedQueued + r.AbortedMidPrefill
		}
		return fmt.Errorf("%w after %d of %d requests; the integrity check did not run", errInterrupted,
			finished, o.requests)
	}
	if runErr != nil {
		return runErr
	}
	for _, r := range reps {
		if err := r.Err(); err != nil {
			return err
		}
	}
	return checkCoverage(reps, o, stderr)
}

// checkCoverage warns (or, with --require-coverage, fails) when too few of
// the checked keys were still in the pool: "integrity OK" then rests on a
// small sample (a small --pool-bytes evicts most chunks before the check).
func checkCoverage(reps []sim.Report, o demoOptions, stderr io.Writer) error {
	var t sim.Report
	for _, r := range reps {
		t.Add(r)
	}
	matched, checked := t.Coverage()
	// Nothing checked is coverage 0, not a pass: "integrity OK" would rest
	// on no byte at all.
	if o.minCoverage == 0 || checked > 0 && float64(matched) >= o.minCoverage*float64(checked) {
		return nil
	}
	msg := fmt.Sprintf("integrity coverage %d of %d keys (0%%) is below --min-coverage %.0f%%: the check "+
		"loaded nothing back", matched, checked, 100*o.minCoverage)
	if checked > 0 {
		msg = fmt.Sprintf("integrity coverage %d of %d keys (%.0f%%) is below --min-coverage %.0f%%: most chunks "+
			"were evicted before the check; a larger --pool-bytes checks more", matched, checked,
			100*float64(matched)/float64(checked), 100*o.minCoverage)
	}
	if o.requireCoverage {
		return errors.New(msg)
	}
	fmt.Fprintln(stderr, "kvactors demo: warning:", msg)
	return nil
}

// demoConfigs splits the requests across engines. All share the seed and
// one namespace, so their shared prefixes are the same keys and deduplicate
// in the pool.
func demoConfigs(o demoOptions, log *slog.Logger, done func()) []sim.Config {
	cfgs := make([]sim.Config, o.engines)
	for i := range cfgs {
		c := sim.DefaultConfig()
		c.Engine = fmt.Sprintf("engine-%d", i+1)
		c.Namespace = "kvactors-demo"
		c.ShmDir = o.shmDir
		c.Requests = o.requests / o.engines
		if i < o.requests%o.engines {
			c.Requests++
		}
		c.StepInterval = o.step
		c.ArrivalsPerStep = float64(c.Requests) * o.step.Seconds() / o.spread.Seconds()
		c.MinOutputTokens, c.MaxOutputTokens = 16, 256
		if o.quick {
			c.MinOutputTokens, c.MaxOutputTokens = 8, 64
		}
		c.NumGPUBlocks = 512 // tight enough for some block-pressure preemption
		c.Seed = o.seed
		c.Log = log
		c.OnRequestDone = done
		if o.engineFault != nil {
			o.engineFault(&c)
		}
		cfgs[i] = c
	}
	return cfgs
}

// runEngines runs one engine per config, each on its own NATS connection
// as separate engine processes would, and returns their reports in order.
func runEngines(ctx context.Context, url string, cfgs []sim.Config) ([]sim.Report, error) {
	conns := make([]*nats.Conn, len(cfgs))
	defer func() {
		for _, nc := range conns {
			if nc != nil {
				nc.Close()
			}
		}
	}()
	for i, c := range cfgs {
		// client.Options: the per-engine inbox prefix NATS permissions allow
		// each engine (docs/SECURITY.md).
		nc, err := nats.Connect(url, append(client.Options(c.Engine), nats.Name("kvactors-demo-"+c.Engine))...)
		if err != nil {
			return nil, fmt.Errorf("engine %s: connect to %s: %w", c.Engine, url, err)
		}
		conns[i] = nc
	}
	reps := make([]sim.Report, len(cfgs))
	errs := make([]error, len(cfgs))
	var wg sync.WaitGroup
	for i, c := range cfgs {
		wg.Go(func() { reps[i], errs[i] = sim.Run(ctx, conns[i], c) })
	}
	wg.Wait()
	return reps, errors.Join(errs...)
}

// demoTracing sets up the node's tracer: the console exporter into
// --trace-file, OTLP with --otlp, and with neither flag whatever
// OTEL_TRACES_EXPORTER says (nothing when it is unset). on reports whether
// any exporter is in use, so the engines trace too.
func demoTracing(ctx context.Context, o demoOptions, stderr io.Writer) (tp trace.TracerProvider, shutdown func() error, on bool, err error) {
	var exporters []string
	var file *os.File
	if o.traceFile != "" {
		f, err := os.Create(o.traceFile)
		if err != nil {
			return nil, nil, false, fmt.Errorf("--trace-file: %w", err)
		}
		file = f
		exporters = append(exporters, tracing.ExporterConsole)
	}
	if o.otlp {
		exporters = append(exporters, tracing.ExporterOTLP)
		fmt.Fprintln(stderr, "kvactors demo: exporting spans by OTLP to $OTEL_EXPORTER_OTLP_ENDPOINT "+
			"(default localhost:4317); to look at them, run Jaeger: docker run --rm -p 16686:16686 -p 4317:4317 "+
			"jaegertracing/all-in-one, then open http://localhost:16686")
	}
	// An empty Exporter lets tracing.Init read OTEL_TRACES_EXPORTER, so the
	// environment recipe of docs/OBSERVABILITY.md works without a flag.
	opts := tracing.Options{Exporter: strings.Join(exporters, ",")}
	if file != nil {
		opts.Writer = file
	}
	tp, tpShutdown, err := tracing.Init(ctx, opts)
	if err != nil {
		if file != nil {
			_ = file.Close()
		}
		return nil, nil, false, err
	}
	_, on = tp.(*sdktrace.TracerProvider) // Init returns a noop provider when nothing exports
	return tp, func() error {
		// Flush the exporters before the file they write to closes.
		err := tpShutdown(context.Background())
		if file != nil {
			err = errors.Join(err, file.Close())
		}
		return err
	}, on, nil
}
