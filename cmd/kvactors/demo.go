package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/schollz/progressbar/v3"
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
}

func demo(args []string) int { return runDemo(args, os.Stdout, os.Stderr) }

// runDemo is `kvactors demo`: a node and simulated engines in one process,
// a progress bar while they run, then the summary and the integrity
// verdict. Exit status: 0 when every check passed, 1 when one failed or
// the run broke, 2 for bad flags.
func runDemo(args []string, stdout, stderr io.Writer) int {
	o, code := parseDemoFlags(args, stderr)
	if code >= 0 {
		return code
	}
	log, err := newDemoLogger(o.logLevel, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "kvactors demo:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := runDemoWith(ctx, o, log, stdout, stderr); err != nil {
		fmt.Fprintln(stderr, "kvactors demo:", err)
		return 1
	}
	return 0
}

func parseDemoFlags(args []string, stderr io.Writer) (demoOptions, int) {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o demoOptions
	fs.IntVar(&o.engines, "engines", 2, "simulated engines, sharing one node and one seed (so their prefixes deduplicate)")
	fs.IntVar(&o.requests, "requests", 400, "requests in all, split across the engines")
	fs.DurationVar(&o.spread, "spread", 30*time.Second, "requests arrive evenly over this long")
	fs.DurationVar(&o.step, "step", 10*time.Millisecond, "scheduler step of each engine")
	fs.StringVar(&o.natsURL, "nats", "", "NATS URL to use instead of an embedded server")
	fs.StringVar(&o.shmDir, "shm-dir", defaultShmDir(), "where engines create their shm segments")
	fs.StringVar(&o.poolBytes, "pool-bytes", "1GiB", "host pool size")
	fs.StringVar(&o.traceFile, "trace-file", "", "write the node's spans to this file (console exporter JSON, one span per object)")
	fs.BoolVar(&o.otlp, "otlp", false, "also export spans by OTLP (OTEL_EXPORTER_OTLP_ENDPOINT, e.g. a local Jaeger)")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the token streams, lengths and fates")
	fs.BoolVar(&o.quick, "quick", false, "a run of about 5 seconds: fewer, shorter requests")
	fs.StringVar(&o.logLevel, "log-level", "error", "log level of the node and engines: debug, info, warn, error, off")
	fs.StringVar(&o.diskDir, "disk-dir", "", "give the node a disk tier here (try a small --pool-bytes: evicted chunks are loaded back from disk)")
	fs.StringVar(&o.diskBytes, "disk-bytes", "4GiB", "the disk tier's budget, with --disk-dir")
	if err := fs.Parse(args); err != nil {
		return o, 2 // flag printed the problem (or the help)
	}
	if o.quick {
		// Explicit flags still win over --quick's defaults.
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
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
	case fs.NArg() > 0:
		fmt.Fprintf(stderr, "kvactors demo: unexpected arguments %q\n", fs.Args())
		return o, 2
	case o.engines < 1 || o.requests < o.engines:
		fmt.Fprintf(stderr, "kvactors demo: want at least one engine and one request per engine (got %d, %d)\n",
			o.engines, o.requests)
		return o, 2
	case o.spread <= 0 || o.step <= 0:
		fmt.Fprintln(stderr, "kvactors demo: --spread and --step must be > 0")
		return o, 2
	}
	return o, -1
}

// defaultShmDir is /dev/shm where it can be written (the real thing), else
// the temp dir (the shm backend works on any directory).
func defaultShmDir() string {
	if f, err := os.CreateTemp("/dev/shm", "kvactors-probe-"); err == nil {
		_ = f.Close()
		_ = os.Remove(f.Name())
		return "/dev/shm"
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
	pool, err := node.ParseBytes(o.poolBytes)
	if err != nil {
		return fmt.Errorf("--pool-bytes: %w", err)
	}
	tp, shutdownTracing, err := demoTracing(ctx, o, stderr)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, shutdownTracing()) }()

	var diskBytes int64
	if o.diskDir != "" {
		if diskBytes, err = node.ParseBytes(o.diskBytes); err != nil {
			return fmt.Errorf("--disk-bytes: %w", err)
		}
	}
	reg := prometheus.NewRegistry()
	n, err := node.Start(ctx, node.Config{NATSURL: o.natsURL, NATSPort: -1, ShmDir: o.shmDir, PoolBytes: pool,
		HTTPAddr: node.HTTPOff, Log: log, Tracer: tp, Registry: reg, DiskDir: o.diskDir, DiskBytes: diskBytes})
	if err != nil {
		return fmt.Errorf("start the node: %w", err)
	}
	defer func() { err = errors.Join(err, n.Close(context.Background())) }()
	fmt.Fprintf(stderr, "kvactors demo: node on %s, %d engines, %d requests, pool %s, shm in %s\n",
		n.NATSURL(), o.engines, o.requests, o.poolBytes, o.shmDir)

	bar := progressbar.NewOptions(o.requests, progressbar.OptionSetWriter(stderr),
		progressbar.OptionSetDescription("requests"), progressbar.OptionShowCount(),
		progressbar.OptionSetElapsedTime(true), progressbar.OptionThrottle(100*time.Millisecond),
		progressbar.OptionOnCompletion(func() { fmt.Fprintln(stderr, "\nchecking every stored chunk byte for byte…") }))
	cfgs := demoConfigs(o, log, func() { _ = bar.Add(1) })
	if o.traceFile != "" || o.otlp {
		// The engines' step spans become the parents of the node's spans.
		for i := range cfgs {
			cfgs[i].Tracer = tp
		}
	}
	reps, runErr := runEngines(ctx, n.NATSURL(), cfgs)
	_ = bar.Finish()
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
	if runErr != nil {
		return runErr
	}
	for _, r := range reps {
		if err := r.Err(); err != nil {
			return err
		}
	}
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
// --trace-file, OTLP with --otlp, nothing otherwise.
func demoTracing(ctx context.Context, o demoOptions, stderr io.Writer) (trace.TracerProvider, func() error, error) {
	var exporters []string
	var file *os.File
	if o.traceFile != "" {
		f, err := os.Create(o.traceFile)
		if err != nil {
			return nil, nil, fmt.Errorf("--trace-file: %w", err)
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
	exp := tracing.ExporterNone
	if len(exporters) > 0 {
		exp = strings.Join(exporters, ",")
	}
	opts := tracing.Options{Exporter: exp}
	if file != nil {
		opts.Writer = file
	}
	tp, shutdown, err := tracing.Init(ctx, opts)
	if err != nil {
		if file != nil {
			_ = file.Close()
		}
		return nil, nil, err
	}
	return tp, func() error {
		// Flush the exporters before the file they write to closes.
		err := shutdown(context.Background())
		if file != nil {
			err = errors.Join(err, file.Close())
		}
		return err
	}, nil
}
