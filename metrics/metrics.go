package metrics

import (
	"regexp"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/internal/buildinfo"
)

// Metrics is every collector set of a node, built on one registerer. The
// sets are embedded so a holder of the whole reads any collector by name; a
// component that needs one subsystem takes only its set.
type Metrics struct {
	*Events
	*Engines
	*Store
	*Pool
	*Transfer
	*Load
	*NATS
	*Actors
}

// Labels are the known values of each label, owned by the packages that
// produce them (node gathers them): Preset creates every child at 0, so
// /metrics shows a counter before its first event and an alert on rate()
// sees 0, not "no data".
type Labels struct {
	Rejected      []string // events_rejected_total reason
	Deferrals     []string // store_deferrals_total reason
	Retries       []string // store_retries_total reason
	Releases      []string // requests_released_total reason
	TransferTypes []string // kv_offload_total_*, transfer_*: transfer_type
	LoadResults   []string // load_requests_total result
	LoadWaits     []string // load_waits_total outcome
	Actors        []string // actor_unexpected_messages_total actor
	PublishKinds  []string // nats_publish_failures_total kind
}

// Preset creates every known child at 0 and resolves the hot ones once.
func (m *Metrics) Preset(l Labels) {
	for _, v := range l.Rejected {
		m.Rejected.WithLabelValues(v)
	}
	for _, v := range l.Deferrals {
		m.deferralBy[v] = m.Deferrals.WithLabelValues(v)
	}
	for _, v := range l.Retries {
		m.retryBy[v] = m.Retries.WithLabelValues(v)
	}
	for _, v := range l.Releases {
		m.releaseBy[v] = m.Releases.WithLabelValues(v)
	}
	for _, v := range l.TransferTypes {
		m.TransferBytes.WithLabelValues(v)
		m.TransferTime.WithLabelValues(v)
		m.CopySize.WithLabelValues(v)
		m.CopyFailures.WithLabelValues(v)
	}
	for _, v := range l.LoadResults {
		m.Loads.WithLabelValues(v)
	}
	for _, v := range l.LoadWaits {
		m.LoadWaits.WithLabelValues(v)
	}
	for _, v := range l.Actors {
		m.Unexpected.WithLabelValues(v)
	}
	for _, v := range l.PublishKinds {
		m.PublishFailures.WithLabelValues(v)
	}
}

// New builds every set and registers them (plus the build info, Go and
// process collectors) on reg.
func New(reg prometheus.Registerer) *Metrics {
	m := &Metrics{Events: NewEvents(reg), Engines: NewEngines(reg), Store: NewStore(reg), Pool: NewPool(reg),
		Transfer: NewTransfer(reg), Load: NewLoad(reg), NATS: NewNATS(reg), Actors: NewActors(reg)}
	reg.MustRegister(buildInfo(), collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(runtimeTail)),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// runtimeTail adds the Go runtime's own account of what a node's store
// latency tail is made of (docs/BENCHMARKS.md, ninth session) to the Go
// collector's defaults: go_sched_latencies_seconds (how long goroutines
// stood runnable before a processor took them; the runtime samples one
// transition in eight), go_cpu_classes_gc_* against go_cpu_classes_total
// and _idle (the collector's CPU, the runtime's estimate, added at the end
// of each cycle), and go_sync_mutex_wait_total_seconds_total (time blocked
// on sync.Mutex and RWMutex, and on the runtime's own locks; an estimate
// scaled from samples).
var runtimeTail = collectors.GoRuntimeMetricsRule{Matcher: regexp.MustCompile(
	`^(/sched/latencies:seconds|/cpu/classes/gc/.*|/cpu/classes/(total|idle):cpu-seconds|/sync/mutex/wait/total:seconds)$`)}

// Discard returns metrics registered nowhere, for tests and benchmarks that
// do not read them.
func Discard() *Metrics { return New(prometheus.NewRegistry()) }

// buildInfo is kvactors_build_info{version,revision,goversion} 1: joins any
// series to the build that produced it.
func buildInfo() prometheus.Collector {
	in := buildinfo.Read()
	g := prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "kvactors", Name: "build_info",
		Help:        "Always 1; the labels say which build is running.",
		ConstLabels: prometheus.Labels{"version": in.Version, "revision": in.Revision, "goversion": in.GoVersion}})
	g.Set(1)
	return g
}

func counter(sub, name, help string) prometheus.Counter {
	return prometheus.NewCounter(prometheus.CounterOpts{Namespace: "kvactors", Subsystem: sub, Name: name, Help: help})
}

func counterVec(sub, name, help, label string) *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "kvactors", Subsystem: sub, Name: name,
		Help: help}, []string{label})
}

func gaugeFunc(sub, name, help string, f func() float64) prometheus.GaugeFunc {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "kvactors", Subsystem: sub, Name: name, Help: help}, f)
}

// latency is a histogram of seconds from 25 µs to about 0.8 s, in factors
// of 2: every store latency the node times (the bench interpolates
// quantiles inside these buckets).
func latency(sub, name, help string) prometheus.Histogram {
	return prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: "kvactors", Subsystem: sub, Name: name, Help: help,
		Buckets: prometheus.ExponentialBuckets(25e-6, 2, 16)})
}

// scraped is a value read at scrape time from whoever set its source last
// (none: T's zero), so the hot path that owns the value sets no gauge.
type scraped[T any] struct{ f atomic.Pointer[func() T] }

func (s *scraped[T]) from(f func() T) { s.f.Store(&f) }

func (s *scraped[T]) get() T {
	if f := s.f.Load(); f != nil {
		return (*f)()
	}
	var zero T
	return zero
}

func gauge(sub, name, help string) prometheus.Gauge {
	return prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "kvactors", Subsystem: sub, Name: name, Help: help})
}

// RegisterPool exports the pool's chunk counts and bytes, read at scrape
// time so the store path never touches a gauge for them.
func RegisterPool(reg prometheus.Registerer, stats func() hostpool.Stats) {
	reg.MustRegister(poolCollector{
		chunks: prometheus.NewDesc("kvactors_pool_chunks", "Pool chunks by state.", []string{"state"}, nil),
		bytes: prometheus.NewDesc("kvactors_pool_bytes",
			"Pool bytes: capacity, data (chunks stored or being stored), free (whole free pages).", []string{"kind"}, nil),
		maxChunks: prometheus.NewDesc("kvactors_pool_max_chunks",
			"Most chunks the pool holds, whatever their size (--pool-max-chunks).", nil, nil),
		stats: stats})
}

type poolCollector struct {
	chunks, bytes, maxChunks *prometheus.Desc
	stats                    func() hostpool.Stats
}

func (p poolCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- p.chunks
	ch <- p.bytes
	ch <- p.maxChunks
}

func (p poolCollector) Collect(ch chan<- prometheus.Metric) {
	st := p.stats()
	for _, v := range []struct {
		state string
		n     int
	}{{"pending", st.Pending}, {"ready", st.Ready}, {"pinned", st.Pinned}} {
		ch <- prometheus.MustNewConstMetric(p.chunks, prometheus.GaugeValue, float64(v.n), v.state)
	}
	for _, v := range []struct {
		kind string
		n    int64
	}{{"capacity", st.Capacity}, {"data", st.Data}, {"free", int64(st.FreePages) * st.PageBytes}} {
		ch <- prometheus.MustNewConstMetric(p.bytes, prometheus.GaugeValue, float64(v.n), v.kind)
	}
	ch <- prometheus.MustNewConstMetric(p.maxChunks, prometheus.GaugeValue, float64(st.MaxChunks))
}

// RegisterDisk exports the disk tier's gauges and counters, read at scrape
// time from its own atomics.
func RegisterDisk(reg prometheus.Registerer, stats func() disk.Stats) {
	reg.MustRegister(diskCollector{stats: stats})
}

type diskCollector struct{ stats func() disk.Stats }

var diskDescs = struct {
	bytes, chunks, budget, queued, hits, evictions, read, write, readTime, writeTime, dropped, raced, discarded, failed,
	retired, undeleted, full *prometheus.Desc
}{
	bytes:     prometheus.NewDesc("kvactors_disk_bytes", "Chunk bytes on disk.", nil, nil),
	chunks:    prometheus.NewDesc("kvactors_disk_chunks", "Chunks on disk.", nil, nil),
	budget:    prometheus.NewDesc("kvactors_disk_budget_bytes", "The disk tier's budget (--disk-bytes).", nil, nil),
	queued:    prometheus.NewDesc("kvactors_disk_queued_bytes", "Evicted bytes waiting for the disk writer.", nil, nil),
	hits:      prometheus.NewDesc("kvactors_disk_hits_total", "Chunks a load read back from disk.", nil, nil),
	evictions: prometheus.NewDesc("kvactors_disk_evictions_total", "Chunks deleted from disk to stay in budget.", nil, nil),
	read:      prometheus.NewDesc("kvactors_disk_read_bytes_total", "Bytes read back from disk.", nil, nil),
	write:     prometheus.NewDesc("kvactors_disk_write_bytes_total", "Bytes written to disk.", nil, nil),
	readTime:  prometheus.NewDesc("kvactors_disk_read_seconds_total", "Time spent reading chunks back (GB/s = read bytes / this).", nil, nil),
	writeTime: prometheus.NewDesc("kvactors_disk_write_seconds_total", "Time spent writing chunks (GB/s = write bytes / this).", nil, nil),
	dropped:   prometheus.NewDesc("kvactors_disk_dropped_total", "Evicted chunks not written: writer queue full (a chunk larger than the queue is taken only into an empty one), closing, larger than the budget, or a key longer than a record holds (4096 bytes).", nil, nil),
	raced:     prometheus.NewDesc("kvactors_disk_raced_total", "Evicted chunks not written because their host bytes changed before the copy-out.", nil, nil),
	discarded: prometheus.NewDesc("kvactors_disk_discarded_total", "Bad records found when the index was rebuilt at open: records skipped for a bad data checksum, and torn tails cut (each with the rest of its segment).", nil, nil),
	failed:    prometheus.NewDesc("kvactors_disk_write_failures_total", "Writes that failed: a chunk's record, or a write of tombstones (retried).", nil, nil),
	retired:   prometheus.NewDesc("kvactors_disk_segments_retired_total", "Segments written no more because a failed write could not be cut back.", nil, nil),
	undeleted: prometheus.NewDesc("kvactors_disk_segment_delete_failures_total", "Segments whose file could not be deleted (kept, counted in the files, and tried again).", nil, nil),
	full:      prometheus.NewDesc("kvactors_disk_full_total", "Writes that found the filesystem full (ENOSPC, EDQUOT): each deleted the oldest segment to make room and tried again. --disk-bytes leaves too little room (docs/OPERATIONS.md).", nil, nil),
}

func (diskCollector) Describe(ch chan<- *prometheus.Desc) {
	d := diskDescs
	for _, x := range []*prometheus.Desc{d.bytes, d.chunks, d.budget, d.queued, d.hits, d.evictions, d.read, d.write,
		d.readTime, d.writeTime, d.dropped, d.raced, d.discarded, d.failed, d.retired, d.undeleted, d.full} {
		ch <- x
	}
}

func (c diskCollector) Collect(ch chan<- prometheus.Metric) {
	st, d := c.stats(), diskDescs
	gauge := func(desc *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(desc, prometheus.GaugeValue, v)
	}
	count := func(desc *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(desc, prometheus.CounterValue, v)
	}
	gauge(d.bytes, float64(st.Bytes))
	gauge(d.chunks, float64(st.Chunks))
	gauge(d.budget, float64(st.Budget))
	gauge(d.queued, float64(st.Queued))
	count(d.hits, float64(st.Hits))
	count(d.evictions, float64(st.Evictions))
	count(d.read, float64(st.ReadBytes))
	count(d.write, float64(st.WriteBytes))
	count(d.readTime, float64(st.ReadNanos)/1e9)
	count(d.writeTime, float64(st.WriteNanos)/1e9)
	count(d.dropped, float64(st.Dropped))
	count(d.raced, float64(st.Raced))
	count(d.discarded, float64(st.Discarded))
	count(d.failed, float64(st.Failed))
	count(d.retired, float64(st.Retired))
	count(d.undeleted, float64(st.RemoveFailed))
	count(d.full, float64(st.Full))
}

// RegisterIsolation exports the isolation bounds' usage, read at scrape
// time: engine segments mapped now (against --max-mapped-segments), their
// mapped bytes (against --max-mapped-bytes), namespaces held, and the bytes
// of hashes and block ids live requests hold (each engine's against
// --max-request-state-bytes).
func RegisterIsolation(reg prometheus.Registerer, mapped, namespaces func() int, mappedBytes, requestState func() int64) {
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvactors_isolation_request_state_bytes",
			Help: "Bytes of hashes and block ids every engine's live requests hold now (each engine's bounded by --max-request-state-bytes)."},
			func() float64 { return float64(requestState()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvactors_isolation_segments_mapped",
			Help: "Engine segments mapped now (bounded by --max-mapped-segments)."},
			func() float64 { return float64(mapped()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvactors_isolation_mapped_bytes",
			Help: "Bytes of engine segments mapped now: each segment's page-rounded span that its regions use (bounded by --max-mapped-bytes)."},
			func() float64 { return float64(mappedBytes()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvactors_isolation_namespaces",
			Help: "Namespaces held (each keeps its geometry until forgotten with the engine id that opened it)."},
			func() float64 { return float64(namespaces()) }))
}

// RegisterIntakeDrops exports the messages nats.go dropped from the node's
// intake subscription (a slow consumer), read at scrape time: nats.go
// reports such a drop once per episode, so kvactors_dropped_batches_total
// {reason="overflow"} counts episodes, this the messages.
func RegisterIntakeDrops(reg prometheus.Registerer, dropped func() int64) {
	reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvactors_intake_nats_dropped_total",
		Help: "Messages the NATS client dropped from the node's intake subscription past its pending limits (a slow consumer); every engine resyncs after such a drop."},
		func() float64 { return float64(dropped()) }))
}

// KVJournal counts the kv_events the journal defers: changes to keys of a
// namespace with no member, kept for the next engine to join it.
type KVJournal struct {
	Deferred        prometheus.Counter
	DeferredDropped prometheus.Counter
}

// RegisterKVJournal exports the pool changes journaled and not yet taken
// for publishing as kv_events, read at scrape time (a backlog that grows
// means the journal's goroutine does not get the CPU to keep up), and
// returns the deferral counters.
func RegisterKVJournal(reg prometheus.Registerer, pending func() int) *KVJournal {
	m := &KVJournal{
		Deferred: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvactors_kv_events_deferred_total",
			Help: "Key changes (one per key) of namespaces with no registered engine, deferred to the next engine that joins the namespace."}),
		DeferredDropped: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvactors_kv_events_deferred_dropped_total",
			Help: "Deferred key changes dropped past the deferral bound; an AllBlocksCleared of their namespace in each medium goes out in their place."}),
	}
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvactors_kv_events_pending",
		Help: "Host pool and disk changes journaled, not yet taken for publishing as kv_events."},
		func() float64 { return float64(pending()) }), m.Deferred, m.DeferredDropped)
	return m
}
