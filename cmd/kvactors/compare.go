package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	kvbench "github.com/kvactors/kvactors/bench"
)

// runCompare is `kvactors bench-compare --a A --b B`: the out-of-process bench
// (bench --external) run in pairs, this binary driving the engines each
// time and A or B serving. On a small shared machine the same binary's runs
// differ by ±20–30%, so one run of each says little: alternating pairs put
// A and B through the same spells of noise, and a change that wins in most
// pairs is more than noise. The order alternates too (AB, BA, AB, …): with
// A always first, one binary compared with itself came out 11% "faster" as
// B, in 3 of 4 pairs (docs/BENCHMARKS.md, sixth session).
func runCompare(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("bench-compare", flag.ContinueOnError)
	binA := fs.String("a", "", "kvactors binary A, the baseline node (required)")
	binB := fs.String("b", "", "kvactors binary B, the node compared with A (required)")
	pairs := fs.Int("pairs", 4, "pairs of runs, AB then BA alternately")
	duration := fs.Duration("duration", 3*time.Second, "each run's --duration")
	engines := fs.Int("engines", 0, "each run's --engines (default: bench's)")
	shmDir := fs.String("shm-dir", "", "each run's --shm-dir (default: bench's)")
	asJSON := fs.Bool("json", false, "print every run's report and the summary as JSON")
	procs := fs.Int("procs", 0, "each run's --external-procs: the node's GOMAXPROCS (default: the machine's)")
	rate := fs.Float64("rate", 0, "pace every run's latency levels at 25% and 50% of this many events/s (0: of the first run's measured rate; -1: each run of its own)")
	note := "A and B are kvactors binaries serving as the node; this binary drives the engines."
	if code := parseExit("bench-compare", parseFlags(fs, args), fs, stdout, stderr, note); code >= 0 {
		return code
	}
	if *binA == "" || *binB == "" || *pairs < 1 || *duration <= 0 {
		fmt.Fprintln(stderr, "kvactors bench-compare: want --a and --b (kvactors binaries), --pairs >= 1 and --duration > 0 (see --help)")
		return exitUsage
	}
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "kvactors bench-compare: %v\n", err)
		return exitFailure
	}
	bins := [2]string{*binA, *binB}
	for i, b := range bins {
		if bins[i], err = filepath.Abs(b); err == nil {
			_, err = os.Stat(bins[i])
		}
		if err != nil {
			fmt.Fprintf(stderr, "kvactors bench-compare: %v\n", err)
			return exitUsage
		}
	}
	base := []string{"bench", "--external", "--json", "--duration", duration.String()}
	if *engines > 0 {
		base = append(base, "--engines", fmt.Sprint(*engines))
	}
	if *shmDir != "" {
		base = append(base, "--shm-dir", *shmDir)
	}
	if *procs > 0 {
		base = append(base, "--external-procs", fmt.Sprint(*procs))
	}
	// The first signal stops the running bench (it stops its serve) and
	// ends the comparison; a second exits at once, the bench dying with
	// this process (kvbench.StartTied).
	ctx, stop := signalContext(func(s os.Signal) {
		fmt.Fprintf(stderr, "\nkvactors bench-compare: second %s: exiting now, the running bench with it\n", signalName(s))
	})
	defer stop()
	defer sayStopping(ctx, stderr, "bench-compare", "the running bench")()
	var cmp comparison
	cmp.A, cmp.B = bins[0], bins[1]
	for p := 1; p <= *pairs; p++ {
		for _, side := range pairOrder(p) {
			bin := bins[side]
			args := append(slices.Clone(base), "--serve-binary", bin)
			if *rate > 0 {
				args = append(args, "--external-rate", fmt.Sprint(*rate))
			}
			ext, err := externalRun(ctx, self, args, stderr)
			if ctx.Err() != nil {
				fmt.Fprintf(stderr, "kvactors bench-compare: interrupted after %d of %d runs; no summary\n", len(cmp.Runs), 2**pairs)
				return exitInterrupted
			}
			if err != nil {
				fmt.Fprintf(stderr, "kvactors bench-compare: pair %d, %s: %v\n", p, bin, err)
				return exitFailure
			}
			if *rate == 0 {
				// The latency levels are paced alike from here on: a build
				// measured faster is not also measured under more load.
				*rate = ext.EventsPerSec
			}
			cmp.Runs = append(cmp.Runs, compareRun{Pair: p, Side: "AB"[side : side+1], External: ext})
			fmt.Fprintf(stderr, "bench-compare: pair %d %s: %.2f µs/event\n", p, "AB"[side:side+1], ext.NodeUSPerEvent)
		}
	}
	cmp.summarize()
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		_ = enc.Encode(cmp)
		return exitOK
	}
	cmp.print(stdout)
	return exitOK
}

// pairOrder is the sides of pair p (from 1) in running order: A first in
// odd pairs, B first in even ones, so neither side always runs first.
func pairOrder(p int) [2]int {
	if p%2 == 0 {
		return [2]int{1, 0}
	}
	return [2]int{0, 1}
}

// externalRun runs one `bench --external --json` and returns its report's
// out-of-process part. The bench dies with this process (StartTied), and
// its serve with the bench: a bench-compare killed outright leaves neither
// running on. ctx's end interrupts the bench, which stops its serve.
func externalRun(ctx context.Context, self string, args []string, stderr io.Writer) (*kvbench.External, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	cmd := exec.Command(self, args...)
	// Through a pipe, not the file: in a process group of its own
	// (StartTied) the bench is in a terminal's background, where writing to
	// it would stop the bench under `stty tostop`.
	cmd.Stderr = struct{ io.Writer }{stderr}
	var out bytes.Buffer
	cmd.Stdout = &out
	exited, err := kvbench.StartTied(cmd, nil)
	if err != nil {
		return nil, fmt.Errorf("start bench: %w", err)
	}
	select {
	case <-exited:
	case <-ctx.Done():
		_ = cmd.Process.Signal(os.Interrupt)
		<-exited
		return nil, ctx.Err()
	}
	if !cmd.ProcessState.Success() {
		return nil, fmt.Errorf("bench: %s", cmd.ProcessState)
	}
	var rep kvbench.Report
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		return nil, fmt.Errorf("bench report: %w", err)
	}
	if rep.External == nil {
		return nil, errors.New("bench report has no external run")
	}
	return rep.External, nil
}

type compareRun struct {
	Pair     int               `json:"pair"`
	Side     string            `json:"side"` // A or B
	External *kvbench.External `json:"external"`
}

// comparison is bench-compare's result: every run, and per metric the mean
// and median of each side, B's change from A's mean, and in how many pairs
// B came out lower.
type comparison struct {
	A       string          `json:"a"`
	B       string          `json:"b"`
	Runs    []compareRun    `json:"runs"`
	Metrics []compareMetric `json:"metrics"`
}

type compareMetric struct {
	Name         string  `json:"name"`
	MeanA        float64 `json:"mean_a"`
	MeanB        float64 `json:"mean_b"`
	MedianA      float64 `json:"median_a"`
	MedianB      float64 `json:"median_b"`
	ChangePct    float64 `json:"change_pct"` // (mean B − mean A) / mean A × 100
	BLowerInPair int     `json:"b_lower_in_pairs"`
	Pairs        int     `json:"pairs"`
}

// compareMetrics are what bench-compare summarizes, in its table's order.
var compareMetrics = []struct {
	name string
	get  func(*kvbench.External) float64
	// zeroIsNone: 0 means the run has no figure (a unit cost the mixes
	// could not give, a level that did not run): it is left out of the
	// means, medians and pairs rather than counted as a very low value.
	zeroIsNone bool
}{
	{"events/s", func(e *kvbench.External) float64 { return e.EventsPerSec }, false},
	{"node µs/event", func(e *kvbench.External) float64 { return e.NodeUSPerEvent }, false},
	{"nothing stored µs/event", func(e *kvbench.External) float64 { return e.NoStoreUSPerEvent }, false},
	{"storing adds µs/chunk", func(e *kvbench.External) float64 { return e.StoreUSPerChunk }, false},
	{"unit µs/stored chunk", func(e *kvbench.External) float64 { return e.UnitUSPerChunk }, true},
	{"unit µs/store job", func(e *kvbench.External) float64 { return e.UnitUSPerJob }, true},
	{"vs raw", func(e *kvbench.External) float64 { return e.Ratio }, false},
	// At 25% per-message costs no longer batch; the level's CPU shows it.
	{"node µs/event at 25%", atLevel(0.25, func(l *kvbench.ExternalLatencyLevel) float64 { return l.NodeUSPerEvent }), true},
	{"node p99 at 50% ms", atLevel(0.5, func(l *kvbench.ExternalLatencyLevel) float64 { return l.NodeP99MS }), false},
	{"client p99 at 50% ms", atLevel(0.5, func(l *kvbench.ExternalLatencyLevel) float64 { return l.ClientP99MS }), false},
	// The runtime's account of the 50% tail (0 against a node built before
	// the metrics): what a change to locking or scheduling should move.
	{"runnable > 1 ms at 50%", atLevel(0.5, func(l *kvbench.ExternalLatencyLevel) float64 { return l.NodeRunnableOver1MS }), true},
	{"mutex wait s at 50%", atLevel(0.5, func(l *kvbench.ExternalLatencyLevel) float64 { return l.NodeMutexWaitSeconds }), true},
}

// atLevel reads get from the run's latency level at fraction (0 when that
// level did not run).
func atLevel(fraction float64, get func(*kvbench.ExternalLatencyLevel) float64) func(*kvbench.External) float64 {
	return func(e *kvbench.External) float64 {
		for i := range e.Latency {
			if e.Latency[i].Fraction == fraction {
				return get(&e.Latency[i])
			}
		}
		return 0
	}
}

func (c *comparison) summarize() {
	c.Metrics = c.Metrics[:0]
	for _, m := range compareMetrics {
		var a, b []float64
		type pair struct {
			v   [2]float64
			has [2]bool
		}
		byPair := map[int]*pair{}
		for _, r := range c.Runs {
			p := byPair[r.Pair]
			if p == nil {
				p = &pair{}
				byPair[r.Pair] = p
			}
			v := m.get(r.External)
			if m.zeroIsNone && v == 0 {
				continue
			}
			side := 1
			if r.Side == "A" {
				side, a = 0, append(a, v)
			} else {
				b = append(b, v)
			}
			p.v[side], p.has[side] = v, true
		}
		cm := compareMetric{Name: m.name, MeanA: mean(a), MeanB: mean(b), MedianA: median(a), MedianB: median(b)}
		if cm.MeanA != 0 {
			cm.ChangePct = (cm.MeanB - cm.MeanA) / cm.MeanA * 100
		}
		for _, p := range byPair {
			if !p.has[0] || !p.has[1] {
				continue // a pair with a side without a figure says nothing
			}
			cm.Pairs++
			if p.v[1] < p.v[0] {
				cm.BLowerInPair++
			}
		}
		c.Metrics = append(c.Metrics, cm)
	}
}

func (c *comparison) print(w io.Writer) {
	fmt.Fprintf(w, "A %s\nB %s\n", c.A, c.B)
	var bases []string
	for _, r := range c.Runs {
		if b := fmt.Sprintf("%.0f", r.External.LatencyBasePerSec); !slices.Contains(bases, b) {
			bases = append(bases, b)
		}
	}
	fmt.Fprintf(w, "latency levels paced at 25%% and 50%% of %s events/s\n\n", strings.Join(bases, ", "))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprint(tw, "pair\tside")
	for _, m := range compareMetrics {
		fmt.Fprintf(tw, "\t%s", m.name)
	}
	fmt.Fprintln(tw)
	for _, r := range c.Runs {
		fmt.Fprintf(tw, "%d\t%s", r.Pair, r.Side)
		for _, m := range compareMetrics {
			fmt.Fprintf(tw, "\t%.2f", m.get(r.External))
		}
		fmt.Fprintln(tw)
	}
	_ = tw.Flush()
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "metric\tmean A\tmean B\tmedian A\tmedian B\tB vs A\tB lower in")
	for _, m := range c.Metrics {
		fmt.Fprintf(tw, "%s\t%.2f\t%.2f\t%.2f\t%.2f\t%+.1f%%\t%d of %d pairs\n", m.Name, m.MeanA, m.MeanB,
			m.MedianA, m.MedianB, m.ChangePct, m.BLowerInPair, m.Pairs)
	}
	_ = tw.Flush()
}

func mean(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := 0.0
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(v))
	if n := len(s); n%2 == 1 {
		return s[n/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
