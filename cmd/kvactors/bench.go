package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	kvbench "github.com/kvactors/kvactors/bench"
)

// benchOptions are the bench command's flags; they fill kvbench.Config.
type benchOptions struct {
	cfg        kvbench.Config
	phases     string
	json       bool
	cpuprofile string
	logLevel   string
	extProfile string
}

func (o *benchOptions) bind(fs *flag.FlagSet) {
	fs.IntVar(&o.cfg.Engines, "engines", 4, "simulated engines publishing at once")
	fs.DurationVar(&o.cfg.Duration, "duration", 0, "length of each measured step (default 3s, 1s with --quick)")
	fs.StringVar(&o.cfg.NATSURL, "nats", "", "NATS server URL (default: an embedded server on a free port)")
	fs.BoolVar(&o.cfg.Quick, "quick", false, "shorter run: 1s steps and 10,000 live requests in the scale phase")
	fs.IntVar(&o.cfg.ScaleRequests, "scale-requests", 0, "live requests in the scale phase (default 100000; 10000 with --quick)")
	fs.StringVar(&o.phases, "phases", strings.Join(kvbench.AllPhases, ","), "comma-separated phases to run")
	fs.StringVar(&o.cfg.ShmDir, "shm-dir", "", "directory for the engines' shm segments (default /dev/shm if writable)")
	fs.BoolVar(&o.json, "json", false, "print the report as JSON instead of tables")
	fs.StringVar(&o.cpuprofile, "cpuprofile", "", "write a CPU profile of the throughput phase's node run to this file")
	fs.BoolVar(&o.cfg.External, "external", false, "also run the store-heavy mix against kvactors serve started as a child process (alone unless --phases is given)")
	fs.StringVar(&o.cfg.ServeBinary, "serve-binary", "", "kvactors binary the --external run starts (default: this one)")
	fs.StringVar(&o.extProfile, "external-cpuprofile", "", "write the child's CPU profile of the --external run to this file")
	fs.StringVar(&o.logLevel, "log-level", "", "show the nodes' logs at this level (default: none; rejections are counted)")
}

func bench(args []string) int {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	var o benchOptions
	o.bind(fs)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "kvactors bench: unexpected arguments %q\n", fs.Args())
		return 2
	}
	o.cfg.Phases = strings.Split(o.phases, ",")
	if o.cfg.External && !flagSet(fs, "phases") {
		o.cfg.Phases = nil // --external alone runs only the out-of-process mix
	}
	o.cfg.Progress = os.Stderr
	if o.logLevel != "" {
		log, err := newLogger(o.logLevel)
		if err != nil {
			fmt.Fprintln(os.Stderr, "kvactors bench:", err)
			return 2
		}
		o.cfg.Log = log
	}
	if err := o.cfg.Validate(); err != nil {
		fmt.Fprintln(os.Stderr, "kvactors bench:", err)
		return 2
	}
	if o.cpuprofile != "" {
		f, err := os.Create(o.cpuprofile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "kvactors bench:", err)
			return 1
		}
		defer f.Close()
		o.cfg.CPUProfile = f
	}
	if o.extProfile != "" {
		f, err := os.Create(o.extProfile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "kvactors bench:", err)
			return 1
		}
		defer f.Close()
		o.cfg.ExternalProfile = f
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep, err := kvbench.Run(ctx, o.cfg)
	if werr := writeReport(os.Stdout, &rep, o.json); werr != nil && err == nil {
		err = werr
	}
	switch {
	case errors.Is(err, context.Canceled):
		fmt.Fprintln(os.Stderr, "kvactors bench: interrupted")
		return 1
	case err != nil:
		fmt.Fprintln(os.Stderr, "kvactors bench:", err)
		return 1
	case !rep.Passed():
		// The numbers are the result; missed goals are reported, not errors.
		fmt.Fprintln(os.Stderr, "kvactors bench: some goals were missed (see GOAL)")
	}
	return 0
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
