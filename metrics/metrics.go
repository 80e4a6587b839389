package metrics

import (
	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/internal/buildinfo"
	"github.com/kvactors/kvactors/messages"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Metrics is every collector of a node. Fields are safe for concurrent use.
type Metrics struct {
	// Events and ingest.
	EventsApplied  prometheus.Counter
	Batches        prometheus.Counter
	BatchDuplicate prometheus.Counter
	EventGaps      prometheus.Counter
	EpochResets    prometheus.Counter
	Rejected       *prometheus.CounterVec // reason
	Unexpected     *prometheus.CounterVec // actor: messages no case handled

	// Sessions and delivery (PROTOCOL.md v2).
	DroppedBatches *prometheus.CounterVec // reason: gap, reconnect, overflow
	Resyncs        *prometheus.CounterVec // reason: gap, reconnect, overflow
	PendingBytes   prometheus.Gauge       // inbound bytes taken, not yet handled
	Expired        prometheus.Counter
	Unregistered   prometheus.Counter
	NATSEvents     *prometheus.CounterVec // event: disconnect, reconnect, slow_consumer, error
	NATSDisconnect *prometheus.CounterVec // cause: eof, stale_connection, timeout, auth, other
	FenceWaits     prometheus.Counter

	// Store scheduling.
	Deferrals      *prometheus.CounterVec // reason: tokens, hashes, blocks
	Retries        *prometheus.CounterVec // reason: pool_full, copy_failed
	ChunksStored   prometheus.Counter
	ChunksDeduped  prometheus.Counter
	ChunksDropped  prometheus.Counter
	Releases       *prometheus.CounterVec // reason
	RequestsLive   prometheus.Gauge
	RequestFailure prometheus.Counter
	DecisionTime   prometheus.Histogram // event received → copy started

	// Transfers.
	TransferBytes *prometheus.CounterVec // transfer_type (vLLM: kv_offload_total_bytes)
	TransferTime  *prometheus.CounterVec // transfer_type (vLLM: kv_offload_total_time)
	CopySize      *prometheus.HistogramVec
	CopyFailures  *prometheus.CounterVec
	JobsInFlight  prometheus.Gauge
	BytesInFlight prometheus.Gauge
	JobsQueued    prometheus.Gauge

	// Pool.
	Evictions     prometheus.Counter
	Corrupt       prometheus.Counter     // chunks whose bytes failed their checksum on a load
	PoolHits      prometheus.Counter     // chunks loaded from host memory
	ChecksumTime  *prometheus.CounterVec // transfer_type: CRC-32C time inside copies
	Lookups       prometheus.Counter
	LookupHits    prometheus.Counter
	HitTokens     prometheus.Counter
	Loads         *prometheus.CounterVec // result: ok, error
	EnginesLive   prometheus.Gauge
	NATSConnected prometheus.Gauge

	// Children of the hot labelled counters, resolved once (WithLabelValues
	// hashes and locks on every call).
	deferralBy map[string]prometheus.Counter
	retryBy    map[string]prometheus.Counter
}

// ResyncReasons are the label values of DroppedBatches and Resyncs.
var ResyncReasons = []string{messages.ResyncGap, messages.ResyncReconnect, messages.ResyncOverflow}

// DisconnectCauses are the label values of NATSDisconnect.
var DisconnectCauses = []string{"eof", "stale_connection", "timeout", "auth", "other"}

// DroppedBatch is DroppedBatches for reason.
func (m *Metrics) DroppedBatch(reason string) prometheus.Counter {
	return m.DroppedBatches.WithLabelValues(reason)
}

// Resync is Resyncs for reason.
func (m *Metrics) Resync(reason string) prometheus.Counter { return m.Resyncs.WithLabelValues(reason) }

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
	Actors        []string // actor_unexpected_messages_total actor
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
		m.Releases.WithLabelValues(v)
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
	for _, v := range l.Actors {
		m.Unexpected.WithLabelValues(v)
	}
}

// Deferral is Deferrals for reason (resolved once by Preset; others on the
// fly).
func (m *Metrics) Deferral(reason string) prometheus.Counter {
	if c, ok := m.deferralBy[reason]; ok {
		return c
	}
	return m.Deferrals.WithLabelValues(reason)
}

// Retry is Retries for reason (resolved once by Preset; others on the fly).
func (m *Metrics) Retry(reason string) prometheus.Counter {
	if c, ok := m.retryBy[reason]; ok {
		return c
	}
	return m.Retries.WithLabelValues(reason)
}

// New builds the collectors and registers them (plus Go and process
// collectors) on reg.
func New(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		EventsApplied:  counter("events", "applied_total", "Protocol events handed to request actors."),
		Batches:        counter("events", "batches_total", "Event batches received."),
		BatchDuplicate: counter("events", "duplicate_batches_total", "Batches ignored because seq was not new."),
		EventGaps:      counter("events", "gaps_total", "Gaps seen (seq jump, lost tail, epoch not starting at 1, reconnect, overflow); never applied."),
		EpochResets:    counter("engine", "resets_total", "Engine resets (new epoch or new spec)."),
		Rejected:       counterVec("events", "rejected_total", "Rejected inputs by reason.", "reason"),
		Unexpected:     counterVec("actor", "unexpected_messages_total", "Messages an actor had no case for.", "actor"),

		DroppedBatches: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvactors_dropped_batches_total",
			Help: "Event batches not applied: taken while their epoch resyncs, or refused by a full inbound queue."},
			[]string{"reason"}),
		Resyncs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvactors_resyncs_total",
			Help: "P.E.resync messages published (repeats included)."}, []string{"reason"}),
		PendingBytes: gauge("ingest", "pending_bytes", "Inbound message bytes taken and not yet handled."),
		Expired:      counter("engine", "expired_total", "Engines expired after a lease without a sign of life."),
		Unregistered: counter("engine", "unregistered_total", "Engines unregistered by P.E.unregister."),
		NATSEvents: counterVec("nats", "events_total",
			"NATS connection events: disconnect, reconnect, slow_consumer, error.", "event"),
		NATSDisconnect: counterVec("nats", "disconnects_total", "NATS disconnects by cause.", "cause"),
		FenceWaits:     counter("transfer", "fence_waits_total", "Copies held back until a NATS round trip was fresh."),

		Deferrals:      counterVec("store", "deferrals_total", "Chunks held back, once per chunk per lagging term.", "reason"),
		Retries:        counterVec("store", "retries_total", "Store decisions retried.", "reason"),
		ChunksStored:   counter("store", "chunks_stored_total", "Chunks copied into the pool."),
		ChunksDeduped:  counter("store", "chunks_deduplicated_total", "Ready chunks already present in the pool."),
		ChunksDropped:  counter("store", "chunks_dropped_total", "Ready chunks given up after the retry limit at finish."),
		Releases:       counterVec("requests", "released_total", "released messages published.", "reason"),
		RequestsLive:   gauge("requests", "live", "Requests tracked."),
		RequestFailure: counter("requests", "failures_total", "Request actors that failed and were released by supervision."),
		DecisionTime: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: "kvactors", Subsystem: "store",
			Name: "decision_seconds", Help: "Time from a batch's arrival to its store job starting to copy.",
			Buckets: prometheus.ExponentialBuckets(25e-6, 2, 16)}),

		TransferBytes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kv_offload_total_bytes",
			Help: "Bytes copied, by direction (vLLM-compatible)."}, []string{"transfer_type"}),
		TransferTime: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kv_offload_total_time",
			Help: "Seconds spent copying, by direction (vLLM-compatible)."}, []string{"transfer_type"}),
		CopySize: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "kvactors", Subsystem: "transfer",
			Name: "copy_size_bytes", Help: "Bytes per copy job.",
			Buckets: prometheus.ExponentialBuckets(4096, 4, 10)}, []string{"transfer_type"}),
		CopyFailures:  counterVec("transfer", "failures_total", "Copy jobs that failed.", "transfer_type"),
		JobsInFlight:  gauge("transfer", "jobs_in_flight", "Copy jobs running."),
		BytesInFlight: gauge("transfer", "bytes_in_flight", "Bytes of copy jobs running."),
		JobsQueued:    gauge("transfer", "jobs_queued", "Copy jobs waiting for a worker."),

		Evictions: counter("pool", "evictions_total", "Ready chunks evicted to make room."),
		Corrupt:   counter("pool", "corrupt_chunks_total", "Chunks dropped because their bytes failed their CRC-32C on a load."),
		PoolHits:  counter("pool", "hits_total", "Chunks loaded from host memory (loads from disk: kvactors_disk_hits_total)."),
		ChecksumTime: counterVec("store", "checksum_seconds_total",
			"Seconds of CRC-32C taken (stores) or checked (loads) inside copies; part of kv_offload_total_time.", "transfer_type"),
		Lookups:       counter("load", "lookups_total", "Lookup requests."),
		LookupHits:    counter("load", "lookup_hits_total", "Lookups with at least one hit token."),
		HitTokens:     counter("load", "hit_tokens_total", "Tokens reported as hits by lookups."),
		Loads:         counterVec("load", "requests_total", "Load requests by result.", "result"),
		EnginesLive:   gauge("engine", "live", "Registered engines."),
		NATSConnected: gauge("nats", "connected", "1 while the NATS connection is up."),
	}
	m.deferralBy = map[string]prometheus.Counter{}
	for _, r := range ResyncReasons {
		m.DroppedBatches.WithLabelValues(r)
		m.Resyncs.WithLabelValues(r)
	}
	for _, e := range []string{"disconnect", "reconnect", "slow_consumer", "error"} {
		m.NATSEvents.WithLabelValues(e)
	}
	for _, c := range DisconnectCauses {
		m.NATSDisconnect.WithLabelValues(c)
	}
	m.retryBy = map[string]prometheus.Counter{}
	reg.MustRegister(m.EventsApplied, m.Batches, m.BatchDuplicate, m.EventGaps, m.EpochResets, m.Rejected,
		m.Unexpected, m.Deferrals, m.Retries, m.ChunksStored, m.ChunksDeduped, m.ChunksDropped, m.Releases,
		m.RequestsLive, m.RequestFailure, m.DecisionTime, m.TransferBytes, m.TransferTime, m.CopySize,
		m.CopyFailures, m.JobsInFlight, m.BytesInFlight, m.JobsQueued, m.Evictions, m.Corrupt, m.PoolHits, m.ChecksumTime, m.Lookups,
		m.LookupHits, m.HitTokens, m.Loads, m.EnginesLive, m.NATSConnected, buildInfo(),
		m.DroppedBatches, m.Resyncs, m.PendingBytes, m.Expired, m.Unregistered, m.NATSEvents, m.NATSDisconnect, m.FenceWaits,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

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
		stats: stats})
}

type poolCollector struct {
	chunks, bytes *prometheus.Desc
	stats         func() hostpool.Stats
}

func (p poolCollector) Describe(ch chan<- *prometheus.Desc) { ch <- p.chunks; ch <- p.bytes }

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
}

// RegisterDisk exports the disk tier's gauges and counters, read at scrape
// time from its own atomics.
func RegisterDisk(reg prometheus.Registerer, stats func() disk.Stats) {
	reg.MustRegister(diskCollector{stats: stats})
}

type diskCollector struct{ stats func() disk.Stats }

var diskDescs = struct {
	bytes, chunks, budget, queued, hits, evictions, read, write, readTime, writeTime, dropped, raced, discarded, failed *prometheus.Desc
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
	dropped:   prometheus.NewDesc("kvactors_disk_dropped_total", "Evicted chunks not written: writer queue full, closing, or larger than the budget.", nil, nil),
	raced:     prometheus.NewDesc("kvactors_disk_raced_total", "Evicted chunks not written because their host bytes changed before the copy-out.", nil, nil),
	discarded: prometheus.NewDesc("kvactors_disk_discarded_total", "Torn or bad files deleted when the index was rebuilt.", nil, nil),
	failed:    prometheus.NewDesc("kvactors_disk_write_failures_total", "Chunk writes that failed.", nil, nil),
}

func (diskCollector) Describe(ch chan<- *prometheus.Desc) {
	d := diskDescs
	for _, x := range []*prometheus.Desc{d.bytes, d.chunks, d.budget, d.queued, d.hits, d.evictions, d.read, d.write,
		d.readTime, d.writeTime, d.dropped, d.raced, d.discarded, d.failed} {
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
}

// RegisterIsolation exports the isolation bounds' usage, read at scrape
// time: engine segments mapped now (against --max-mapped-segments) and
// namespaces opened this boot.
func RegisterIsolation(reg prometheus.Registerer, mapped, namespaces func() int) {
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvactors_isolation_segments_mapped",
			Help: "Engine segments mapped now (bounded by --max-mapped-segments)."},
			func() float64 { return float64(mapped()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvactors_isolation_namespaces",
			Help: "Namespaces opened in this boot (each keeps its geometry for the boot)."},
			func() float64 { return float64(namespaces()) }))
}
