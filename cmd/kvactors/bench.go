package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	kvbench "github.com/kvactors/kvactors/bench"
	"github.com/kvactors/kvactors/node"
)

// benchOptions are the bench command's flags; they fill kvbench.Config.
type benchOptions struct {
	cfg        kvbench.Config
	phases     string
	json       bool
	cpuprofile string
	logLevel   string
	extProfile string
	extAllocs  string
	extTrace   string
	extLevel   string
}

func (o *benchOptions) bind(fs *flag.FlagSet) {
	d := kvbench.DefaultConfig()
	fs.IntVar(&o.cfg.Engines, "engines", d.Engines, "simulated engines publishing at once")
	fs.DurationVar(&o.cfg.Duration, "duration", 0, fmt.Sprintf("length of each measured step (default %v; %v with --quick)", d.Duration, kvbench.QuickDuration))
	fs.StringVar(&o.cfg.NATSURL, "nats", "", "NATS server URL (default: an embedded server on a free port)")
	fs.BoolVar(&o.cfg.Quick, "quick", false, fmt.Sprintf("shorter run: %v steps and %d live requests in the scale phase", kvbench.QuickDuration, kvbench.QuickScaleRequests))
	fs.IntVar(&o.cfg.ScaleRequests, "scale-requests", 0, fmt.Sprintf("live requests in the scale phase (default %d; %d with --quick)", d.ScaleRequests, kvbench.QuickScaleRequests))
	fs.StringVar(&o.phases, "phases", strings.Join(d.Phases, ","), "comma-separated phases to run")
	fs.StringVar(&o.cfg.ShmDir, "shm-dir", "", "directory for the engines' shm segments (default /dev/shm if writable)")
	fs.BoolVar(&o.json, "json", false, "print the report as JSON instead of tables")
	fs.StringVar(&o.cpuprofile, "cpuprofile", "", "write a CPU profile of the throughput phase's node run to this file")
	fs.BoolVar(&o.cfg.External, "external", false, "also run the store-heavy mix against kvactors serve started as a child process (alone unless --phases is given)")
	fs.StringVar(&o.cfg.ServeBinary, "serve-binary", "", "kvactors binary the --external run starts (default: this one)")
	fs.StringVar(&o.extProfile, "external-cpuprofile", "", "write the child's CPU profile of the --external run to this file")
	fs.Float64Var(&o.cfg.ExternalRate, "external-rate", 0, "pace the --external latency levels at 25% and 50% of this many events/s (default: of the run's own measured rate)")
	fs.IntVar(&o.cfg.ExternalProcs, "external-procs", 0, "the --external child's GOMAXPROCS (default: the machine's, or GOMAXPROCS if set): give the node the cores the engines leave it")
	fs.StringVar(&o.extAllocs, "external-memprofile", "", "write the child's allocation profile (/debug/pprof/allocs) after the --external store-heavy run to this file")
	fs.StringVar(&o.extTrace, "external-trace", "", "write the child's execution trace (/debug/pprof/trace) over the --external 50% latency level to this file (go tool trace -pprof=sync FILE: what its goroutines waited on)")
	fs.StringVar(&o.extLevel, "external-level-cpuprofile", "", "write the child's CPU profile over the --external 50% latency level to this file (where mid-load CPU per event goes)")
	fs.IntVar(&o.cfg.ExternalBurst, "external-burst", 0, "also publish this many requests at once through SDK engines against a child of its own and report its peak RSS, store delay and resyncs (alone unless --phases or --external is given; issue 14 uses 40000)")
	fs.Int64Var(&o.cfg.ExternalBurstBudget, "external-burst-budget", 0, "the burst child's --max-pending-bytes (default: the node's default)")
	fs.StringVar(&o.logLevel, "log-level", "", "show the nodes' logs at this level (default: none; rejections are counted)")
}

// runBench is `kvactors bench`. Missed goals are reported, not an error:
// the numbers are the result. Exit status: 130 when interrupted, and at
// once (130 or 143) on a second Ctrl-C or SIGTERM while it stops.
func runBench(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	var o benchOptions
	o.bind(fs)
	if code := parseExit("bench", parseFlags(fs, args), fs, stdout, stderr); code >= 0 {
		return code
	}
	o.cfg.Phases = strings.Split(o.phases, ",")
	if (o.cfg.External || o.cfg.ExternalBurst > 0) && !flagSet(fs, "phases") {
		o.cfg.Phases = nil // --external and --external-burst alone run only out of process
	}
	o.cfg.Progress = stderr
	if o.logLevel != "" {
		log, err := node.Config{LogLevel: o.logLevel}.NewLogger(stderr)
		if err != nil {
			fmt.Fprintf(stderr, "kvactors bench: %v (see kvactors bench --help)\n", err)
			return exitUsage
		}
		o.cfg.Log = log
	}
	if err := o.cfg.Validate(); err != nil {
		fmt.Fprintf(stderr, "kvactors bench: %v (see kvactors bench --help)\n", err)
		return exitUsage
	}
	if (o.extProfile != "" || o.extAllocs != "" || o.extTrace != "" || o.extLevel != "") && !o.cfg.External {
		fmt.Fprintln(stderr, "kvactors bench: --external-cpuprofile, --external-memprofile, --external-trace and --external-level-cpuprofile profile the --external run: add --external (see kvactors bench --help)")
		return exitUsage
	}
	// Each profile flag names a file the run writes into.
	for _, out := range []struct {
		path string
		to   *io.Writer
	}{{o.cpuprofile, &o.cfg.CPUProfile}, {o.extProfile, &o.cfg.ExternalProfile}, {o.extAllocs, &o.cfg.ExternalAllocs}, {o.extTrace, &o.cfg.ExternalTrace}, {o.extLevel, &o.cfg.ExternalLevelProfile}} {
		if out.path == "" {
			continue
		}
		f, err := os.Create(out.path)
		if err != nil {
			fmt.Fprintln(stderr, "kvactors bench:", err)
			return exitFailure
		}
		defer f.Close()
		*out.to = f
	}
	// A second signal while the first's stop is held up (a child serve
	// slow to stop waits up to 30 s) exits at once: the serve dies with
	// the bench (kvbench.StartTied).
	ctx, stop := signalContext(func(s os.Signal) {
		fmt.Fprintf(stderr, "\nkvactors bench: second %s: exiting now, without waiting for its node to stop\n", signalName(s))
	})
	defer stop()
	defer sayStopping(ctx, stderr, "bench", "its phase and node")()
	rep, err := kvbench.Run(ctx, o.cfg)
	if werr := writeReport(stdout, &rep, o.json); werr != nil && err == nil {
		err = werr
	}
	switch {
	case errors.Is(err, context.Canceled):
		fmt.Fprintln(stderr, "kvactors bench: interrupted; the phases above finished")
		return exitInterrupted
	case err != nil:
		fmt.Fprintln(stderr, "kvactors bench:", err)
		return exitFailure
	case !rep.Passed():
		fmt.Fprintln(stderr, "kvactors bench: some goals were missed (see GOAL)")
	}
	return exitOK
}

func writeReport(w io.Writer, rep *kvbench.Report, asJSON bool) error {
	if !asJSON {
		return rep.WriteTable(w)
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}

// flagSet reports whether flag name was given on the command line.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
