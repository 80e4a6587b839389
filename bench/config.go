package bench

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvactors/kvactors/backend/shm"
)

// Phase names, in the order Run runs them.
const (
	PhaseThroughput = "throughput"
	PhaseLatency    = "latency"
	PhaseCopy       = "copy"
	PhaseScale      = "scale"
)

// AllPhases is every phase, in run order.
var AllPhases = []string{PhaseThroughput, PhaseLatency, PhaseCopy, PhaseScale}

// Goals of issue 5.
const (
	GoalEventsPerSec = 500_000 // node events/s at saturation
	GoalRawRatio     = 0.5     // node events/s over raw NATS+decode events/s
	GoalP99          = 2 * time.Millisecond
	GoalCopyRatio    = 0.9 // shm backend GB/s over plain copy() GB/s
)

// Config is every setting of a bench run. Zero fields take their defaults
// (withDefaults); Quick shrinks the defaults for a fast look.
type Config struct {
	// Engines is the number of simulated engines publishing at once
	// (default 4).
	Engines int
	// Duration bounds each measured phase step: the saturation run, each
	// latency level, the copy runs together, each scale throughput run
	// (default 3s; 1s with Quick).
	Duration time.Duration
	// NATSURL uses an existing NATS server; empty starts an embedded one on
	// a free port for each node.
	NATSURL string
	// Quick shrinks the run: shorter phases and ScaleRequests 10,000.
	Quick bool
	// Phases selects phases (default AllPhases). Latency needs the
	// saturation rate, so it runs the throughput phase too.
	Phases []string
	// ScaleRequests is the live request count of the scale phase (default
	// 100,000; 10,000 with Quick); ScaleBase the comparison size (1,000).
	ScaleRequests int
	ScaleBase     int
	// CopySizes are the block sizes of the copy phase (default 64 KiB,
	// 512 KiB, 2 MiB).
	CopySizes []int64
	// Window is the flow-control window: batches published but not yet
	// taken by the node (default 2048). The node's inbound queue holds
	// 65,536 messages; past it NATS drops them as a slow consumer.
	Window int
	// ShmDir holds the engines' segments (default /dev/shm when writable,
	// else a temp dir).
	ShmDir string
	// CPUProfile, when set, receives a CPU profile of the throughput
	// phase's node run (runtime/pprof).
	CPUProfile io.Writer
	// Log receives the nodes' logs (default: discarded; rejected events are
	// counted in the report instead). Progress, when set, receives one line
	// per phase step.
	Log      *slog.Logger
	Progress io.Writer
	// External adds the out-of-process run (issue 14): ServeBinary serve
	// (default: this executable) as a child process, driven over NATS.
	// ExternalProfile, when set, receives the child's CPU profile of that
	// run (its /debug/pprof/profile); ExternalAllocs its allocation
	// profile at the end of the store-heavy run (/debug/pprof/allocs);
	// ExternalTrace its execution trace over the 50% latency level
	// (/debug/pprof/trace), where the tail is: `go tool trace -pprof=sync`
	// shows what the node's goroutines waited on (docs/BENCHMARKS.md);
	// ExternalLevelProfile its CPU profile over that level: at mid load the
	// node spends half again as much per event as at saturation, and the
	// saturated profile does not show where.
	External             bool
	ServeBinary          string
	ExternalProfile      io.Writer
	ExternalAllocs       io.Writer
	ExternalTrace        io.Writer
	ExternalLevelProfile io.Writer
	// ExternalRate, when positive, is the events/s the external latency
	// levels take their fractions of, instead of the run's own measured
	// rate: two builds paced alike have their p99s taken under the same
	// load (bench-compare).
	ExternalRate float64
	// ExternalProcs, when positive, is the child's GOMAXPROCS: the cores
	// the node may run on at once, so that node and engines together do not
	// ask the machine for more cores than it has (docs/BENCHMARKS.md, tenth
	// session).
	ExternalProcs int
	// ExternalBurst, when positive, adds the burst run (issue 14's bounded
	// memory): that many requests published at once by SDK engines against
	// a child of its own; ExternalBurstBudget is its --max-pending-bytes
	// (0: the node's default).
	ExternalBurst       int
	ExternalBurstBudget int64
}

// DefaultConfig is every setting's default at full size (the bench flags
// read theirs from here); Quick's smaller sizes are QuickDuration and
// QuickScaleRequests.
func DefaultConfig() Config {
	return Config{Engines: 4, Duration: 3 * time.Second, Phases: AllPhases, ScaleRequests: 100_000,
		ScaleBase: 1_000, CopySizes: []int64{64 << 10, 512 << 10, 2 << 20}, Window: 2048}
}

// Quick's defaults (the rest are DefaultConfig's).
const (
	QuickDuration      = time.Second
	QuickScaleRequests = 10_000
)

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.Quick {
		d.Duration, d.ScaleRequests = QuickDuration, QuickScaleRequests
	}
	if c.Engines == 0 {
		c.Engines = d.Engines
	}
	if c.Duration == 0 {
		c.Duration = d.Duration
	}
	if len(c.Phases) == 0 && !c.External && c.ExternalBurst == 0 {
		c.Phases = d.Phases
	}
	if c.ScaleRequests == 0 {
		c.ScaleRequests = d.ScaleRequests
	}
	if c.ScaleBase == 0 {
		c.ScaleBase = min(d.ScaleBase, c.ScaleRequests)
	}
	if len(c.CopySizes) == 0 {
		c.CopySizes = d.CopySizes
	}
	if c.Window == 0 {
		c.Window = d.Window
	}
	if c.ShmDir == "" {
		c.ShmDir = os.TempDir()
		if unix.Access(shm.DefaultDir, unix.W_OK) == nil {
			c.ShmDir = shm.DefaultDir
		}
	}
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	if c.Progress == nil {
		c.Progress = io.Discard
	}
	return c
}

// ErrConfig wraps every configuration error.
var ErrConfig = errors.New("bad bench config")

// Validate reports the first bad setting.
func (c Config) Validate() error {
	c = c.withDefaults()
	switch {
	case c.Engines < 1 || c.Engines > 64:
		return fmt.Errorf("%w: engines %d: want 1..64", ErrConfig, c.Engines)
	case c.Duration < 10*time.Millisecond || c.Duration > 10*time.Minute:
		return fmt.Errorf("%w: duration %v: want 10ms..10m", ErrConfig, c.Duration)
	case c.ScaleRequests < c.Engines || c.ScaleRequests > 10_000_000:
		return fmt.Errorf("%w: scale requests %d: want engines..10,000,000", ErrConfig, c.ScaleRequests)
	case c.ScaleBase < c.Engines || c.ScaleBase > c.ScaleRequests:
		return fmt.Errorf("%w: scale base %d: want engines..scale requests", ErrConfig, c.ScaleBase)
	case c.Window < 1 || c.Window > 16_384:
		return fmt.Errorf("%w: window %d: want 1..16384 batches", ErrConfig, c.Window)
	case c.ExternalBurst < 0 || c.ExternalBurst > 1_000_000:
		return fmt.Errorf("%w: burst %d requests: want 0..1,000,000", ErrConfig, c.ExternalBurst)
	case c.ExternalBurst > 0 && c.ExternalBurst < c.Engines:
		return fmt.Errorf("%w: burst %d requests: want at least one per engine (%d)", ErrConfig, c.ExternalBurst, c.Engines)
	case c.ExternalProcs < 0 || c.ExternalProcs > 1024:
		return fmt.Errorf("%w: external procs %d: want 0 (the default) to 1024", ErrConfig, c.ExternalProcs)
	case c.ExternalBurstBudget < 0:
		return fmt.Errorf("%w: burst budget %d bytes: want 0 (the node's default) or more", ErrConfig, c.ExternalBurstBudget)
	}
	for _, s := range c.CopySizes {
		if s < 4096 || s > 64<<20 {
			return fmt.Errorf("%w: copy size %d: want 4 KiB..64 MiB", ErrConfig, s)
		}
	}
	for _, p := range c.Phases {
		if !c.known(p) {
			return fmt.Errorf("%w: phase %q: want one of %s", ErrConfig, p, strings.Join(AllPhases, ", "))
		}
	}
	return nil
}

func (c Config) known(p string) bool {
	for _, q := range AllPhases {
		if p == q {
			return true
		}
	}
	return false
}

// wants reports whether phase p runs (latency pulls in throughput).
func (c Config) wants(p string) bool {
	for _, q := range c.Phases {
		if q == p || (p == PhaseThroughput && q == PhaseLatency) {
			return true
		}
	}
	return false
}
