package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Metric names read from the node (package metrics).
const (
	mApplied  = "kvactors_events_applied_total"
	mBatches  = "kvactors_events_batches_total"
	mRejected = "kvactors_events_rejected_total"
	mStored   = "kvactors_store_chunks_stored_total"
	mDeduped  = "kvactors_store_chunks_deduplicated_total"
	mDecision = "kvactors_store_decision_seconds"
	// mQueueWait is the part of a decision's time after the job's submission.
	mQueueWait = "kvactors_transfer_queue_wait_seconds"
	// mStoredTime runs on to the stored message's publish.
	mStoredTime = "kvactors_store_stored_seconds"
	// mIntakeWait is the part of it before the batch's ingest worker starts.
	mIntakeWait = "kvactors_ingest_wait_seconds"
	mBytes      = "kv_offload_total_bytes"
	mCopyTime   = "kv_offload_total_time"
	mReqsLive   = "kvactors_requests_live"
	mPending    = "kvactors_store_retries_pending"
	// mGoroutines is the Go collector's goroutine count.
	mGoroutines = "go_goroutines"
	// mGCPauses is the Go collector's summary of GC pauses: its count is
	// the collections so far.
	mGCPauses = "go_gc_duration_seconds"
	// The runtime metrics a node exports beside the defaults
	// (metrics.runtimeTail).
	mSchedLatency = "go_sched_latencies_seconds"
	mGCCPU        = "go_cpu_classes_gc_total_cpu_seconds_total"
	mCPUTotal     = "go_cpu_classes_total_cpu_seconds_total"
	mCPUIdle      = "go_cpu_classes_idle_cpu_seconds_total"
	mMutexWait    = "go_sync_mutex_wait_total_seconds_total"
)

// counter reads one of the node's counters. Gathering the whole registry
// costs tens of microseconds (Go and process collectors), too much for a
// flow-control loop, so fastCounter gets hold of the collector itself.
type counter func() float64

// fastCounter returns a reader of counter name registered on reg (with
// label=value when label is not empty; the metric must have a sample
// already). It registers an identical collector, which the registry refuses
// with AlreadyRegisteredError naming the existing one (client_golang's
// documented way to reach a registered collector); failing that it gathers.
func fastCounter(reg *prometheus.Registry, name, label, value string) (counter, error) {
	fam, err := family(reg, name)
	if err != nil {
		return nil, err
	}
	opts := prometheus.CounterOpts{Name: name, Help: fam.GetHelp()}
	var probe prometheus.Collector = prometheus.NewCounter(opts)
	if label != "" {
		probe = prometheus.NewCounterVec(opts, []string{label})
	}
	err = reg.Register(probe)
	if err == nil {
		reg.Unregister(probe)
		return nil, fmt.Errorf("metric %s: gathered but not registered as a counter", name)
	}
	var c prometheus.Counter
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		switch e := are.ExistingCollector.(type) {
		case prometheus.Counter:
			c = e
		case *prometheus.CounterVec:
			c, _ = e.GetMetricWithLabelValues(value)
		}
	}
	if c == nil {
		return func() float64 { return gatherSum(reg, name, label, value) }, nil
	}
	return func() float64 {
		var m dto.Metric
		_ = c.Write(&m)
		return m.GetCounter().GetValue()
	}, nil
}

func family(reg prometheus.Gatherer, name string) (*dto.MetricFamily, error) {
	fams, err := reg.Gather()
	if err != nil {
		return nil, fmt.Errorf("gather metrics: %w", err)
	}
	for _, f := range fams {
		if f.GetName() == name {
			return f, nil
		}
	}
	return nil, fmt.Errorf("metric %s not found", name)
}

// gatherSum is the sum of name's counter, gauge or histogram-count samples
// whose label (if given) has value; 0 when the metric has no samples yet.
func gatherSum(reg prometheus.Gatherer, name, label, value string) float64 {
	f, err := family(reg, name)
	if err != nil {
		return 0
	}
	var sum float64
	for _, m := range f.GetMetric() {
		if label != "" && !hasLabel(m, label, value) {
			continue
		}
		switch {
		case m.Counter != nil:
			sum += m.GetCounter().GetValue()
		case m.Gauge != nil:
			sum += m.GetGauge().GetValue()
		case m.Histogram != nil:
			sum += float64(m.GetHistogram().GetSampleCount())
		case m.Summary != nil:
			sum += float64(m.GetSummary().GetSampleCount())
		}
	}
	return sum
}

func hasLabel(m *dto.Metric, name, value string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == name && l.GetValue() == value {
			return true
		}
	}
	return false
}

// histogram is a snapshot of a Prometheus histogram: cumulative counts per
// upper bound (the last bound is +Inf).
type histogram struct {
	bounds []float64
	counts []uint64
}

func snapshot(reg prometheus.Gatherer, name string) histogram {
	var h histogram
	f, err := family(reg, name)
	if err != nil || len(f.GetMetric()) == 0 || f.GetMetric()[0].Histogram == nil {
		return h
	}
	hp := f.GetMetric()[0].GetHistogram()
	for _, b := range hp.GetBucket() {
		h.bounds = append(h.bounds, b.GetUpperBound())
		h.counts = append(h.counts, b.GetCumulativeCount())
	}
	h.bounds = append(h.bounds, math.Inf(1))
	h.counts = append(h.counts, hp.GetSampleCount())
	return h
}

// minus is h's observations since before.
func (h histogram) minus(before histogram) histogram {
	d := histogram{bounds: h.bounds, counts: append([]uint64(nil), h.counts...)}
	for i := range d.counts {
		if i < len(before.counts) {
			d.counts[i] -= before.counts[i]
		}
	}
	return d
}

func (h histogram) count() uint64 {
	if len(h.counts) == 0 {
		return 0
	}
	return h.counts[len(h.counts)-1]
}

// quantile estimates the q-quantile by linear interpolation inside the
// bucket that holds it (as PromQL's histogram_quantile does). A quantile in
// the +Inf bucket is reported as the last finite bound.
func (h histogram) quantile(q float64) float64 {
	n := h.count()
	if n == 0 {
		return 0 // no observations (JSON has no NaN)
	}
	rank := q * float64(n)
	lower, below := 0.0, uint64(0)
	for i, c := range h.counts {
		if float64(c) >= rank {
			if math.IsInf(h.bounds[i], 1) {
				return lower
			}
			inBucket := c - below
			if inBucket == 0 {
				return h.bounds[i]
			}
			return lower + (h.bounds[i]-lower)*(rank-float64(below))/float64(inBucket)
		}
		lower, below = h.bounds[i], c
	}
	return lower
}

// overNear is the share of h's observations above the bucket bound nearest
// to x (in ratio): for a histogram with coarse buckets, such as the Go
// runtime's scheduling latencies (bounds ~11x apart), a share over a bound
// says more than a quantile interpolated inside a bucket.
func (h histogram) overNear(x float64) float64 {
	n := h.count()
	if n == 0 {
		return 0
	}
	best, dist := -1, math.Inf(1)
	for i, b := range h.bounds {
		if math.IsInf(b, 1) || b <= 0 {
			continue
		}
		if d := math.Abs(math.Log(b / x)); d < dist {
			best, dist = i, d
		}
	}
	if best < 0 {
		return 0
	}
	return float64(n-h.counts[best]) / float64(n)
}

// scrape reads another process's metrics from its Prometheus endpoint url
// (a node's /metrics, text exposition format) into a Gatherer, so snapshot
// and gatherSum read them as they read an in-process registry. Histograms
// drop their +Inf bucket, which the text format spells out and a registry's
// Gather leaves implicit (snapshot adds it from the sample count).
func scrape(ctx context.Context, url string) (prometheus.Gatherer, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("scrape %s: %s", url, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	byName, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	fams := make([]*dto.MetricFamily, 0, len(byName))
	for _, f := range byName {
		for _, m := range f.GetMetric() {
			if h := m.GetHistogram(); h != nil {
				h.Bucket = slices.DeleteFunc(h.Bucket, func(b *dto.Bucket) bool { return math.IsInf(b.GetUpperBound(), 1) })
			}
		}
		fams = append(fams, f)
	}
	return prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) { return fams, nil }), nil
}

// residentBytes is this process's resident set size (/proc/self/statm).
func residentBytes() int64 {
	data, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0
	}
	fields := strings.Fields(string(data))
	if len(fields) < 2 {
		return 0
	}
	pages, err := strconv.ParseInt(fields[1], 10, 64)
	if err != nil {
		return 0
	}
	return pages * int64(os.Getpagesize())
}
