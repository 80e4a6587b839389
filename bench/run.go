package bench

import (
	"context"
	"runtime"
	"time"
)

// Run measures what cfg selects, phase by phase, each on a fresh node, and
// judges the results against issue 5's goals. A phase that fails ends the
// run with its error; the report holds the phases done before it.
func Run(ctx context.Context, cfg Config) (Report, error) {
	if err := cfg.Validate(); err != nil {
		return Report{}, err
	}
	cfg = cfg.withDefaults()
	rep := Report{Machine: machine(cfg), Engines: cfg.Engines, Duration: cfg.Duration.String(), Quick: cfg.Quick,
		Started: time.Now().UTC().Truncate(time.Second)}
	var err error
	if cfg.wants(PhaseThroughput) {
		if rep.Throughput, err = runThroughput(ctx, cfg); err != nil {
			return rep, phaseErr(PhaseThroughput, err)
		}
		runtime.GC()
	}
	if cfg.wants(PhaseLatency) {
		if rep.Latency, err = runLatency(ctx, cfg, rep.Throughput.EventsPerSec); err != nil {
			return rep, phaseErr(PhaseLatency, err)
		}
		runtime.GC()
	}
	if cfg.wants(PhaseCopy) {
		if rep.Copy, err = runCopy(ctx, cfg); err != nil {
			return rep, phaseErr(PhaseCopy, err)
		}
		runtime.GC()
	}
	if cfg.wants(PhaseScale) {
		if rep.Scale, err = runScale(ctx, cfg); err != nil {
			return rep, phaseErr(PhaseScale, err)
		}
	}
	if cfg.External {
		if rep.External, err = runExternal(ctx, cfg); err != nil {
			return rep, phaseErr("external", err)
		}
	}
	if cfg.ExternalBurst > 0 {
		if rep.Burst, err = runExternalBurst(ctx, cfg); err != nil {
			return rep, phaseErr("external burst", err)
		}
	}
	rep.goals()
	return rep, nil
}

// PhaseError says which phase failed.
type PhaseError struct {
	Phase string
	Err   error
}

func (e *PhaseError) Error() string { return "bench " + e.Phase + ": " + e.Err.Error() }
func (e *PhaseError) Unwrap() error { return e.Err }

func phaseErr(phase string, err error) error { return &PhaseError{Phase: phase, Err: err} }
