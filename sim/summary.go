package sim

import (
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// NodeStats is what a node's Prometheus registry says about a run: the
// numbers only kvactors knows (why chunks waited, how long decisions took,
// how fast copies ran).
type NodeStats struct {
	EventsApplied float64
	Batches       float64
	Rejected      map[string]float64 // by reason
	Deferrals     map[string]float64 // by lagging term
	Retries       map[string]float64 // by reason
	ChunksStored  float64
	ChunksDeduped float64
	ChunksDropped float64
	Evictions     float64
	Releases      map[string]float64 // by reason
	CopyBytes     map[string]float64 // by transfer_type
	CopySeconds   map[string]float64 // by transfer_type
	Loads         map[string]float64 // by result
	// DecisionP50 and DecisionP99 are quantiles of the time from a batch's
	// arrival to its store job starting to copy, interpolated within the
	// histogram's buckets (as PromQL's histogram_quantile does); zero when
	// nothing was observed (Decisions is the number of observations).
	DecisionP50, DecisionP99 time.Duration
	Decisions                float64
}

// GatherNodeStats reads a node's registry (node.Config.Registry).
func GatherNodeStats(g prometheus.Gatherer) (NodeStats, error) {
	families, err := g.Gather()
	if err != nil {
		return NodeStats{}, fmt.Errorf("sim: gather node metrics: %w", err)
	}
	s := NodeStats{Rejected: map[string]float64{}, Deferrals: map[string]float64{}, Retries: map[string]float64{},
		Releases: map[string]float64{}, CopyBytes: map[string]float64{}, CopySeconds: map[string]float64{},
		Loads: map[string]float64{}}
	byLabel := map[string]struct {
		m     map[string]float64
		label string
	}{
		"kvactors_events_rejected_total":   {s.Rejected, "reason"},
		"kvactors_store_deferrals_total":   {s.Deferrals, "reason"},
		"kvactors_store_retries_total":     {s.Retries, "reason"},
		"kvactors_requests_released_total": {s.Releases, "reason"},
		"kv_offload_total_bytes":           {s.CopyBytes, "transfer_type"},
		"kv_offload_total_time":            {s.CopySeconds, "transfer_type"},
		"kvactors_load_requests_total":     {s.Loads, "result"},
	}
	plain := map[string]*float64{
		"kvactors_events_applied_total":            &s.EventsApplied,
		"kvactors_events_batches_total":            &s.Batches,
		"kvactors_store_chunks_stored_total":       &s.ChunksStored,
		"kvactors_store_chunks_deduplicated_total": &s.ChunksDeduped,
		"kvactors_store_chunks_dropped_total":      &s.ChunksDropped,
		"kvactors_pool_evictions_total":            &s.Evictions,
	}
	for _, f := range families {
		name := f.GetName()
		for _, m := range f.GetMetric() {
			switch {
			case name == "kvactors_store_decision_seconds" && m.GetHistogram() != nil:
				h := m.GetHistogram()
				s.Decisions = float64(h.GetSampleCount())
				s.DecisionP50 = seconds(Quantile(0.5, h))
				s.DecisionP99 = seconds(Quantile(0.99, h))
			case plain[name] != nil:
				*plain[name] += value(m)
			default:
				// Children preset at 0 (node metrics.Preset) are not news.
				if bl, ok := byLabel[name]; ok && value(m) != 0 {
					bl.m[label(m, bl.label)] += value(m)
				}
			}
		}
	}
	return s, nil
}

func value(m *dto.Metric) float64 {
	switch {
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	}
	return 0
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

func seconds(s float64) time.Duration {
	if math.IsNaN(s) {
		return 0
	}
	return time.Duration(s * float64(time.Second))
}

// Quantile estimates the q-quantile of a histogram the way PromQL's
// histogram_quantile does: find the bucket holding the rank, interpolate
// linearly inside it (the first bucket from 0). A rank in the +Inf bucket
// answers the highest finite bound. NaN when the histogram is empty.
func Quantile(q float64, h *dto.Histogram) float64 {
	total := float64(h.GetSampleCount())
	if total == 0 || q < 0 || q > 1 {
		return math.NaN()
	}
	rank := q * total
	lower, below := 0.0, 0.0
	for _, b := range h.GetBucket() {
		upper, count := b.GetUpperBound(), float64(b.GetCumulativeCount())
		if count >= rank {
			if math.IsInf(upper, 1) {
				return lower
			}
			if count == below {
				return upper
			}
			return lower + (upper-lower)*(rank-below)/(count-below)
		}
		lower, below = upper, count
	}
	return lower // every sample above the last finite bound
}

// WriteSummary prints the demo's table: what the engines did and found
// (their Reports summed), what the node says about it, and the verdict.
// serving is the wall time of the serving part (for the rates).
func WriteSummary(w io.Writer, reps []Report, node NodeStats, serving time.Duration) {
	var t Report
	for _, r := range reps {
		t.Add(r)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	row := func(name, format string, a ...any) { fmt.Fprintf(tw, "%s\t"+format+"\n", append([]any{name}, a...)...) }
	secs := serving.Seconds()
	row("engines", "%d, %s serving, %s in all (the check included)", len(reps), serving.Round(time.Millisecond),
		t.Elapsed.Round(time.Millisecond))
	row("requests", "%d: %d finished, %d aborted while queued, %d aborted in prefill", t.Requests, t.Finished,
		t.AbortedQueued, t.AbortedMidPrefill)
	row("preemptions", "%d (%d by block pressure), %d resumed, %d with a prefix-cache hit", t.Preemptions,
		t.PreemptedPressure, t.Resumes, t.ResumeHits)
	row("events", "%d sent in %d batches (%.0f/s); node: %.0f batches received, %.0f events applied to live "+
		"requests (each request's added starts it, not counted), rejected %s",
		t.Events, t.Batches, rate(float64(t.Events), secs), node.Batches, node.EventsApplied, counts(node.Rejected))
	row("chunks stored", "%d reported in %d stored messages; node: %.0f copied into the pool, %.0f already there "+
		"(deduplicated), %.0f dropped, %.0f evicted later", t.ChunksStored, t.StoredJobs, node.ChunksStored,
		node.ChunksDeduped, node.ChunksDropped, node.Evictions)
	row("ready at finish", "%d: %d stored, %d deduplicated, %d evicted, %d skipped (null before a resume), %d missing",
		t.ChunksReady, t.ReadyStored, t.Deduplicated, t.ReadyEvicted, t.ReadySkipped, t.Missing)
	if t.ReadyNodeLost > 0 {
		row("ready, node lost", "%d absent in requests released as node_lost", t.ReadyNodeLost)
	}
	if t.Resyncs+t.NodeLosses+t.DroppedBatches > 0 {
		row("sessions", "%d resyncs (new epochs), %d node losses, %d batches dropped on purpose", t.Resyncs,
			t.NodeLosses, t.DroppedBatches)
	}
	row("deferred", "%s", counts(node.Deferrals))
	row("retried", "%s", counts(node.Retries))
	for _, dir := range slices.Sorted(maps.Keys(node.CopyBytes)) {
		b, s := node.CopyBytes[dir], node.CopySeconds[dir]
		row("copied "+dir, "%s in %.3fs of copy time: %s/s (%s/s over the run)", bytesIEC(b), s,
			bytesDec(rate(b, s)), bytesDec(rate(b, secs)))
	}
	if node.Decisions > 0 {
		row("decision latency", "p50 %s, p99 %s over %.0f jobs (batch received → copy started)",
			node.DecisionP50.Round(time.Microsecond), node.DecisionP99.Round(time.Microsecond), node.Decisions)
	}
	row("releases", "%s; %d duplicate, %d missing, %d unknown, %d unexpected at the SDK (%d unowed resets)",
		intCounts(t.Releases), t.DuplicateReleases, t.MissingReleases, t.UnknownReleases, t.UnexpectedReleases,
		t.UnowedResets)
	row("check", "%d lookups (%d hit tokens), %d loads (node: %s)", t.Lookups, t.LookupHitTokens,
		int(node.Loads["ok"]+node.Loads["error"]), counts(node.Loads))
	matched, checked := t.Coverage()
	switch {
	case t.Interrupted:
		row("integrity", "not checked: the run was interrupted")
	case t.CheckSkipped:
		row("integrity", "not checked: the run broke off before the check finished")
	default:
		verdict := "OK"
		if err := combinedErr(reps); err != nil {
			verdict = "FAILED"
		}
		row("integrity", "%s: %d of %d keys checked matched byte for byte (%s; coverage %.0f%%), %d evicted "+
			"before the check, %d failed, %d bad messages (each engine checks every key it saw stored or present, "+
			"so keys two engines share count twice)", verdict, matched, checked, bytesIEC(float64(t.VerifiedBytes)),
			100*ratio(matched, checked), t.VerifyEvicted, t.VerifyFailed, t.BadMessages)
	}
	_ = tw.Flush()
	for _, f := range t.Failures {
		fmt.Fprintf(w, "  failure: %s\n", f)
	}
}

func combinedErr(reps []Report) error {
	for i := range reps {
		if err := reps[i].Err(); err != nil {
			return err
		}
	}
	return nil
}

// ratio is n/d, 0 for d = 0.
func ratio(n, d int) float64 {
	if d == 0 {
		return 0
	}
	return float64(n) / float64(d)
}

func rate(n, secs float64) float64 {
	if secs <= 0 {
		return 0
	}
	return n / secs
}

func counts(m map[string]float64) string {
	if len(m) == 0 {
		return "none"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s %.0f", k, m[k]))
	}
	return strings.Join(parts, ", ")
}

func intCounts(m map[string]int) string {
	f := make(map[string]float64, len(m))
	for k, v := range m {
		f[k] = float64(v)
	}
	return counts(f)
}

func bytesIEC(b float64) string {
	const unit = 1024
	if b < unit {
		return fmt.Sprintf("%.0f B", b)
	}
	div, exp := float64(unit), 0
	for n := b / unit; n >= unit && exp < 4; n /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", b/div, "KMGTP"[exp])
}

func bytesDec(b float64) string {
	switch {
	case b >= 1e9:
		return fmt.Sprintf("%.2f GB", b/1e9)
	case b >= 1e6:
		return fmt.Sprintf("%.1f MB", b/1e6)
	case b >= 1e3:
		return fmt.Sprintf("%.1f kB", b/1e3)
	}
	return fmt.Sprintf("%.0f B", b)
}
