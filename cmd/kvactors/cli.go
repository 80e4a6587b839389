package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sync"
	"syscall"
)

// Exit codes, the same for every command (docs/OPERATIONS.md).
const (
	exitOK      = 0 // success, or --help
	exitFailure = 1 // a runtime failure: start failed, a check failed
	exitUsage   = 2 // a bad flag, argument, variable, config file or value
	// 3 is node.FailStopExit: serve ended itself because fencing demanded it.
	exitInterrupted = 130 // demo, bench or bench-compare stopped by Ctrl-C or SIGTERM (128+SIGINT)
	// 128+signal: a second SIGINT or SIGTERM forced the exit (signalContext).
)

// parseFlags parses a command's flags; no command takes positional
// arguments, so one is an error rather than the silent end of the flags.
func parseFlags(fs *flag.FlagSet, args []string) error {
	fs.SetOutput(io.Discard) // parseExit prints one line, not the usage
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q: %s takes flags only", fs.Arg(0), fs.Name())
	}
	return nil
}

// parseExit turns a parse error into what the user sees and the exit code:
// -1 to go on; 0 after printing the usage (and notes) for --help; 2 after
// printing the problem as one line that points at --help.
func parseExit(cmd string, err error, fs *flag.FlagSet, stdout, stderr io.Writer, notes ...string) int {
	switch {
	case err == nil:
		return -1
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprintf(stdout, "usage: kvactors %s [flags]\n\n", cmd)
		for _, n := range notes {
			fmt.Fprintln(stdout, n)
		}
		if len(notes) > 0 {
			fmt.Fprintln(stdout)
		}
		fs.SetOutput(stdout)
		fs.PrintDefaults()
		return exitOK
	}
	fmt.Fprintf(stderr, "kvactors %s: %v (see kvactors %s --help)\n", cmd, err, cmd)
	return exitUsage
}

// signalContext is cancelled by the first SIGINT or SIGTERM: a graceful
// stop. A second one, while that stop is held up, exits at once with
// 128+its number (130, 143: what the signal's default action gives), after
// forced has said so: the rule of nats-server and prometheus. stop ends the
// handling, and the process's.
func signalContext(forced func(os.Signal)) (ctx context.Context, stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		for first := true; ; first = false {
			select {
			case <-done:
				return
			case s := <-sigs:
				if first {
					cancel()
					continue
				}
				forced(s)
				code := 128 + int(syscall.SIGINT)
				if n, ok := s.(syscall.Signal); ok {
					code = 128 + int(n)
				}
				os.Exit(code)
			}
		}
	}()
	var once sync.Once
	return ctx, func() {
		once.Do(func() {
			signal.Stop(sigs)
			close(done)
			cancel()
		})
	}
}

// sayStopping prints, once the first signal has ended ctx, that cmd is
// stopping what and that a second signal exits at once: what the user
// waits on, and the sign that the second will force the exit. Call the
// returned func before signalContext's stop, whose cancel is no signal.
func sayStopping(ctx context.Context, w io.Writer, cmd, what string) (stop func() bool) {
	return context.AfterFunc(ctx, func() {
		fmt.Fprintf(w, "\nkvactors %s: stopping %s (a second Ctrl-C or SIGTERM exits at once)\n", cmd, what)
	})
}

// signalName is SIGINT or SIGTERM (os.Signal's String says "interrupt",
// "terminated").
func signalName(s os.Signal) string {
	switch s {
	case syscall.SIGINT:
		return "SIGINT"
	case syscall.SIGTERM:
		return "SIGTERM"
	}
	return s.String()
}
