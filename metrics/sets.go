package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvactors/kvactors/messages"
)

// Each set below is one subsystem's collectors (the subsystem in their
// names), built and registered by its own constructor on the registerer
// passed in; a nil registerer leaves them unregistered (tests). Fields are
// safe for concurrent use.

// Events are the inbound path's collectors: batches, events, rejections,
// delivery (PROTOCOL.md v2: gaps never applied, resyncs).
type Events struct {
	EventsApplied  prometheus.Counter
	Batches        prometheus.Counter
	BatchDuplicate prometheus.Counter
	EventGaps      prometheus.Counter
	Rejected       *prometheus.CounterVec // reason
	DroppedBatches *prometheus.CounterVec // reason: gap, reconnect, overflow
	Resyncs        *prometheus.CounterVec // reason: gap, reconnect, overflow
	// PendingBytes are the inbound bytes taken and not yet handled, read at
	// scrape time (ReadPendingFrom): intake touches no gauge per message.
	PendingBytes prometheus.GaugeFunc
	// FullestBucketBytes are the pending bytes counted in the fullest of
	// intake's buckets of engine ids (each may hold half the budget counted;
	// a calm intake, a quarter of the budget or less, counts in none), read
	// at scrape time too: near that share, an engine (or a few sharing its
	// bucket) is flooding.
	FullestBucketBytes prometheus.GaugeFunc
	// IntakeWait is an events batch's wait between intake taking it and its
	// ingest worker starting on it: the node's queueing before any decision
	// (a worker whose turn stalls holds back every batch of its engines).
	IntakeWait prometheus.Histogram

	pending, fullest scraped[int64]
}

// ReadPendingFrom makes PendingBytes read pending at scrape time (the last
// intake to call it wins; none: 0).
func (m *Events) ReadPendingFrom(pending func() int64) { m.pending.from(pending) }

// ReadFullestBucketFrom makes FullestBucketBytes read fullest at scrape
// time (the last intake to call it wins; none: 0).
func (m *Events) ReadFullestBucketFrom(fullest func() int64) { m.fullest.from(fullest) }

// ResyncReasons are the label values of DroppedBatches and Resyncs.
var ResyncReasons = []string{messages.ResyncGap, messages.ResyncReconnect, messages.ResyncOverflow}

// NewEvents builds the inbound collectors, with every resync reason at 0.
func NewEvents(reg prometheus.Registerer) *Events {
	m := &Events{
		EventsApplied:  counter("events", "applied_total", "Protocol events handed to request actors."),
		Batches:        counter("events", "batches_total", "Event batches received."),
		BatchDuplicate: counter("events", "duplicate_batches_total", "Batches ignored because seq was not new."),
		EventGaps:      counter("events", "gaps_total", "Gaps seen (seq jump, lost tail, epoch not starting at 1, reconnect, overflow); never applied."),
		Rejected:       counterVec("events", "rejected_total", "Rejected inputs by reason.", "reason"),
		DroppedBatches: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvactors_dropped_batches_total",
			Help: "Event batches not applied: taken while their epoch resyncs, or refused by a full inbound queue."},
			[]string{"reason"}),
		Resyncs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvactors_resyncs_total",
			Help: "P.E.resync messages published (repeats included)."}, []string{"reason"}),
		IntakeWait: latency("ingest", "wait_seconds",
			"Time an events batch waited between intake taking it and its ingest worker starting on it."),
	}
	m.PendingBytes = gaugeFunc("ingest", "pending_bytes", "Inbound message bytes taken and not yet handled.",
		func() float64 { return float64(m.pending.get()) })
	m.FullestBucketBytes = gaugeFunc("ingest", "fullest_bucket_bytes",
		"Inbound message bytes taken and not yet handled of the fullest bucket of engine ids.",
		func() float64 { return float64(m.fullest.get()) })
	for _, r := range ResyncReasons {
		m.DroppedBatches.WithLabelValues(r)
		m.Resyncs.WithLabelValues(r)
	}
	register(reg, m.EventsApplied, m.Batches, m.BatchDuplicate, m.EventGaps, m.Rejected, m.DroppedBatches,
		m.Resyncs, m.PendingBytes, m.FullestBucketBytes, m.IntakeWait)
	return m
}

// DroppedBatch is DroppedBatches for reason.
func (m *Events) DroppedBatch(reason string) prometheus.Counter {
	return m.DroppedBatches.WithLabelValues(reason)
}

// Resync is Resyncs for reason.
func (m *Events) Resync(reason string) prometheus.Counter { return m.Resyncs.WithLabelValues(reason) }

// Engines are the engine sessions' collectors.
type Engines struct {
	EnginesLive  prometheus.Gauge   // registered now
	EpochResets  prometheus.Counter // a new epoch or spec reset the engine's requests
	Expired      prometheus.Counter // a lease without a sign of life
	Unregistered prometheus.Counter // P.E.unregister
	Failures     prometheus.Counter // an engine actor failed (a bug) and ended its engine
	// Silences counts engines heard again after lease/2 or more without a
	// message (their requests reset: transfer.Hearing).
	Silences prometheus.Counter
}

// NewEngines builds the engine session collectors.
func NewEngines(reg prometheus.Registerer) *Engines {
	m := &Engines{
		EnginesLive: gauge("engine", "live", "Registered engines."),
		EpochResets: counter("engine", "resets_total",
			"Engine resets (new epoch or new spec)."),
		Expired: counter("engine", "expired_total",
			"Engines expired after a lease without a sign of life."),
		Unregistered: counter("engine", "unregistered_total", "Engines unregistered by P.E.unregister."),
		Failures: counter("engine", "failures_total",
			"Engine actors that failed (a bug) and ended their engine as on unregister."),
		Silences: counter("engine", "silences_total",
			"Engines heard again after lease/2 or more without a message: their requests were reset and the epoch resynced."),
	}
	register(reg, m.EnginesLive, m.EpochResets, m.Expired, m.Unregistered, m.Failures, m.Silences)
	return m
}

// Store are the store decisions' and requests' collectors.
type Store struct {
	Deferrals      *prometheus.CounterVec // reason: tokens, hashes, blocks
	Retries        *prometheus.CounterVec // retries armed; reason: pool_full, copy_failed, pending
	RetriesPending prometheus.Gauge       // requests whose retry timer has not fired
	ChunksStored   prometheus.Counter
	// StoredTime is the node's part of a store, the batch's arrival (intake
	// takes it; nats.go's pending queue before that is not counted) to the
	// job's stored message handed to NATS (decision_seconds ends at the
	// copy's start). A job completed while the node shuts down is counted
	// though its stored message is not sent (Outbox.Seal).
	StoredTime     prometheus.Histogram
	ChunksDeduped  prometheus.Counter
	ChunksDropped  prometheus.Counter
	Evictions      prometheus.Counter
	Releases       *prometheus.CounterVec // reason
	RequestsLive   prometheus.Gauge
	RequestFailure prometheus.Counter

	// Children of the hot labelled counters, resolved once (WithLabelValues
	// hashes and locks on every call).
	deferralBy map[string]prometheus.Counter
	retryBy    map[string]prometheus.Counter
	releaseBy  map[string]prometheus.Counter
}

// NewStore builds the store and request collectors.
func NewStore(reg prometheus.Registerer) *Store {
	m := &Store{
		Deferrals:      counterVec("store", "deferrals_total", "Chunks held back, once per chunk per lagging term.", "reason"),
		Retries:        counterVec("store", "retries_total", "Store retries armed, by the failure that armed them (a failed decision while one is armed is not counted).", "reason"),
		RetriesPending: gauge("store", "retries_pending", "Retry timers not yet fired (a burst into a full pool shows here; a request released meanwhile, or a retry taken early when what it waited for happened, is counted until its timer falls due, at most 1 s)."),
		ChunksStored:   counter("store", "chunks_stored_total", "Chunks copied into the pool."),
		StoredTime: latency("store", "stored_seconds",
			"Time from a batch's arrival to the stored message of a job it made ready being published."),
		ChunksDeduped:  counter("store", "chunks_deduplicated_total", "Ready chunks already present in the pool."),
		ChunksDropped:  counter("store", "chunks_dropped_total", "Ready chunks given up after the retry limit at finish."),
		Evictions:      counter("pool", "evictions_total", "Ready chunks evicted to make room."),
		Releases:       counterVec("requests", "released_total", "released messages published.", "reason"),
		RequestsLive:   gauge("requests", "live", "Requests tracked."),
		RequestFailure: counter("requests", "failures_total", "Request actors that failed and were released by supervision."),
		deferralBy:     map[string]prometheus.Counter{},
		retryBy:        map[string]prometheus.Counter{},
		releaseBy:      map[string]prometheus.Counter{},
	}
	register(reg, m.Deferrals, m.Retries, m.RetriesPending, m.ChunksStored, m.StoredTime, m.ChunksDeduped, m.ChunksDropped, m.Evictions,
		m.Releases, m.RequestsLive, m.RequestFailure)
	return m
}

// Deferral is Deferrals for reason (resolved once by Metrics.Preset; others
// on the fly).
func (m *Store) Deferral(reason string) prometheus.Counter {
	if c, ok := m.deferralBy[reason]; ok {
		return c
	}
	return m.Deferrals.WithLabelValues(reason)
}

// Release is Releases for reason (resolved once by Metrics.Preset; others
// on the fly): one per released request.
func (m *Store) Release(reason string) prometheus.Counter {
	if c, ok := m.releaseBy[reason]; ok {
		return c
	}
	return m.Releases.WithLabelValues(reason)
}

// Retry is Retries for reason (resolved once by Metrics.Preset; others on
// the fly).
func (m *Store) Retry(reason string) prometheus.Counter {
	if c, ok := m.retryBy[reason]; ok {
		return c
	}
	return m.Retries.WithLabelValues(reason)
}

// Pool are the collectors of the pool's copy path (package store): hits,
// checksums, corrupt chunks. The pool's sizes are read at scrape time
// (RegisterPool); its evictions are counted with the store decisions that
// cause them (Store).
type Pool struct {
	Corrupt      prometheus.Counter     // chunks whose bytes failed their checksum on a load, could not be read from the disk tier, or of another size than their group's
	PoolHits     prometheus.Counter     // chunks a load copied out of host memory (its copy done)
	ChecksumTime *prometheus.CounterVec // transfer_type: CRC-32C time inside copies
}

// NewPool builds the copy path's collectors.
func NewPool(reg prometheus.Registerer) *Pool {
	m := &Pool{
		Corrupt:  counter("pool", "corrupt_chunks_total", "Chunks dropped because their bytes failed their CRC-32C on a load, could not be read from the disk tier (an I/O error, a file cut short), or their size is not their group's chunk size."),
		PoolHits: counter("pool", "hits_total", "Chunks a load copied out of host memory, counted once its copy is done (loads from disk: kvactors_disk_hits_total)."),
		ChecksumTime: counterVec("store", "checksum_seconds_total",
			"Seconds of CRC-32C taken (stores) or checked (loads) inside copies; part of kv_offload_total_time.", "transfer_type"),
	}
	register(reg, m.Corrupt, m.PoolHits, m.ChecksumTime)
	return m
}

// Transfer are the copy workers' collectors. The byte and time counters keep
// vLLM's names (kv_offload_total_*) so its dashboards work.
type Transfer struct {
	TransferBytes *prometheus.CounterVec // transfer_type (vLLM: kv_offload_total_bytes)
	TransferTime  *prometheus.CounterVec // transfer_type (vLLM: kv_offload_total_time)
	CopySize      *prometheus.HistogramVec
	CopyFailures  *prometheus.CounterVec
	// The copy queue's gauges read its state at scrape time (ReadQueueFrom):
	// the copy path touches none of them.
	JobsInFlight  prometheus.GaugeFunc
	BytesInFlight prometheus.GaugeFunc
	JobsQueued    prometheus.GaugeFunc
	FenceWaits    prometheus.Counter
	// FenceLapses counts lapses (no NATS round trip for 3/4 lease: an engine
	// may have declared the node lost); CopiesLapsed the copies the fence
	// refused for them (not in CopyFailures).
	FenceLapses  prometheus.Counter
	CopiesLapsed prometheus.Counter
	// CopiesSilent counts copies refused, or stopped while running, because
	// their engine had not been heard from for lease/2 (not in
	// CopyFailures).
	CopiesSilent prometheus.Counter
	// CopiesFenced counts copies stopped between two device calls because
	// the node had no NATS round trip for lease/2 (not in CopyFailures).
	CopiesFenced prometheus.Counter
	// ThenFailures counts Drain Thens that panicked (recovered by the
	// copy queue: the release a Then carried is lost, the engine's end it
	// gives back is not).
	ThenFailures prometheus.Counter
	// AbortFailures counts Store.Aborts that panicked (recovered by the
	// copy queue: that job's pool side is left as it was; the owner's other
	// jobs are still aborted and its Drain still answered).
	AbortFailures prometheus.Counter
	// CopyPanics counts Store.Copys that panicked (recovered on the copy
	// worker: the job is aborted and fails, so its owner retries it).
	CopyPanics prometheus.Counter
	// DecisionTime keeps its store_ name: it measures a store decision, from
	// the batch's arrival to its copy starting, which only the copier sees.
	DecisionTime prometheus.Histogram
	// QueueWait is the part of it after the decision: a copy job's
	// submission to its copy starting (a worker's wake-up, the jobs ahead).
	QueueWait prometheus.Histogram

	queue scraped[QueueState]
}

// QueueState is the copy queue's state: jobs waiting, jobs running and the
// bytes of the running ones.
type QueueState struct {
	Queued, Running int
	BytesInFlight   int64
}

// ReadQueueFrom makes the queue gauges read state at scrape time (the last
// queue to call it wins; none: zeros).
func (m *Transfer) ReadQueueFrom(state func() QueueState) { m.queue.from(state) }

// NewTransfer builds the copy collectors.
func NewTransfer(reg prometheus.Registerer) *Transfer {
	m := &Transfer{
		TransferBytes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kv_offload_total_bytes",
			Help: "Bytes copied, by direction (vLLM-compatible)."}, []string{"transfer_type"}),
		TransferTime: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kv_offload_total_time",
			Help: "Seconds spent copying, by direction (vLLM-compatible)."}, []string{"transfer_type"}),
		CopySize: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "kvactors", Subsystem: "transfer",
			Name: "copy_size_bytes", Help: "Bytes per copy job.",
			Buckets: prometheus.ExponentialBuckets(4096, 4, 10)}, []string{"transfer_type"}),
		CopyFailures: counterVec("transfer", "failures_total", "Copy jobs that failed.", "transfer_type"),
		FenceWaits:   counter("transfer", "fence_waits_total", "Copies held back until a NATS round trip was fresh."),
		FenceLapses: counter("transfer", "fence_lapses_total",
			"Times the node had no NATS round trip for 3/4 lease (an engine may have declared it lost)."),
		CopiesLapsed: counter("transfer", "copies_lapsed_total",
			"Copies refused because their session began before a lapse (never started)."),
		CopiesSilent: counter("transfer", "copies_engine_silent_total",
			"Copies refused or stopped because their engine had not been heard from for lease/2 (never started, or stopped between device calls)."),
		CopiesFenced: counter("transfer", "copies_fenced_total",
			"Copies stopped between two device calls because the node had no NATS round trip for lease/2."),
		ThenFailures: counter("transfer", "then_failures_total",
			"Drain Thens that panicked (recovered; the release a Then carried is lost)."),
		AbortFailures: counter("transfer", "abort_failures_total",
			"Store Aborts of cancelled copies that panicked (recovered; that job's pool side is left as it was)."),
		CopyPanics: counter("transfer", "copy_panics_total",
			"Store Copys that panicked (recovered; the job is aborted and fails, and its owner retries it)."),
		DecisionTime: latency("store", "decision_seconds", "Time from a batch's arrival to its store job starting to copy."),
		QueueWait:    latency("transfer", "queue_wait_seconds", "Time from a copy job's submission to its copy starting."),
	}
	m.JobsInFlight = gaugeFunc("transfer", "jobs_in_flight", "Copy jobs running.",
		func() float64 { return float64(m.queue.get().Running) })
	m.BytesInFlight = gaugeFunc("transfer", "bytes_in_flight", "Bytes of copy jobs running.",
		func() float64 { return float64(m.queue.get().BytesInFlight) })
	m.JobsQueued = gaugeFunc("transfer", "jobs_queued", "Copy jobs waiting for a worker.",
		func() float64 { return float64(m.queue.get().Queued) })
	register(reg, m.TransferBytes, m.TransferTime, m.CopySize, m.CopyFailures, m.JobsInFlight, m.BytesInFlight,
		m.JobsQueued, m.FenceWaits, m.FenceLapses, m.CopiesLapsed, m.CopiesSilent, m.CopiesFenced, m.ThenFailures, m.AbortFailures, m.CopyPanics,
		m.DecisionTime, m.QueueWait)
	return m
}

// Load are the lookup and load collectors.
type Load struct {
	Lookups    prometheus.Counter
	LookupHits prometheus.Counter
	HitTokens  prometheus.Counter
	Loads      *prometheus.CounterVec // result: ok, error
	// LoadWaits counts loads that found a key pending in another copy, by
	// how their wait ended (node: loaded, timed_out, too_many, aborted,
	// failed); LoadRetries their tries again, LoadWaitTime how long each
	// waited.
	LoadWaits    *prometheus.CounterVec
	LoadRetries  prometheus.Counter
	LoadWaitTime prometheus.Histogram
}

// NewLoad builds the lookup and load collectors.
func NewLoad(reg prometheus.Registerer) *Load {
	m := &Load{
		Lookups:    counter("load", "lookups_total", "Lookup requests."),
		LookupHits: counter("load", "lookup_hits_total", "Lookups with at least one hit token."),
		HitTokens:  counter("load", "hit_tokens_total", "Tokens reported as hits by lookups."),
		Loads:      counterVec("load", "requests_total", "Load requests by result.", "result"),
		LoadWaits: counterVec("load", "waits_total",
			"Loads that found a key pending in another copy, by how the wait ended.", "outcome"),
		LoadRetries: counter("load", "retries_total",
			"Tries again of loads waiting for a key pending in another copy (each wake-up, and the last at --load-wait)."),
		// 1 ms to about 4 s: --load-wait is 2 s by default, at most lease/2.
		LoadWaitTime: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: "kvactors", Subsystem: "load",
			Name: "wait_seconds", Help: "How long a load waited for keys pending in another copy.",
			Buckets: prometheus.ExponentialBuckets(1e-3, 2, 13)}),
	}
	register(reg, m.Lookups, m.LookupHits, m.HitTokens, m.Loads, m.LoadWaits, m.LoadRetries, m.LoadWaitTime)
	return m
}

// NATS are the NATS connection's collectors.
type NATS struct {
	NATSConnected  prometheus.Gauge
	NATSEvents     *prometheus.CounterVec // event: disconnect, reconnect, slow_consumer, error
	NATSDisconnect *prometheus.CounterVec // cause: eof, stale_connection, timeout, auth, other
	// IDConflicts counts what the node heard from another process using
	// its node id (node/identity.go).
	IDConflicts prometheus.Counter
	// PublishFailures counts the node's outgoing messages lost to a
	// publish error (actors.Outbox), by kind (actors.PublishKinds).
	PublishFailures *prometheus.CounterVec
}

// DisconnectCauses are the label values of NATSDisconnect.
var DisconnectCauses = []string{"eof", "stale_connection", "timeout", "auth", "other"}

// NewNATS builds the connection collectors, every event and cause at 0.
func NewNATS(reg prometheus.Registerer) *NATS {
	m := &NATS{
		NATSConnected: gauge("nats", "connected", "1 while the NATS connection is up."),
		NATSEvents: counterVec("nats", "events_total",
			"NATS connection events: disconnect, reconnect, slow_consumer, error.", "event"),
		NATSDisconnect: counterVec("nats", "disconnects_total", "NATS disconnects by cause.", "cause"),
		IDConflicts: counter("node", "id_conflicts_total",
			"Hellos and heartbeats heard from another process using this node's id (two must never share one)."),
		PublishFailures: counterVec("nats", "publish_failures_total",
			"Outgoing messages the NATS client refused (closed, reconnect buffer full, over max_payload), by kind: lost, not retried.", "kind"),
	}
	for _, e := range []string{"disconnect", "reconnect", "slow_consumer", "error"} {
		m.NATSEvents.WithLabelValues(e)
	}
	for _, c := range DisconnectCauses {
		m.NATSDisconnect.WithLabelValues(c)
	}
	register(reg, m.NATSConnected, m.NATSEvents, m.NATSDisconnect, m.IDConflicts, m.PublishFailures)
	return m
}

// Actors count messages an actor had no case for, by actor kind.
type Actors struct {
	Unexpected *prometheus.CounterVec // actor
}

// NewActors builds the actor collectors.
func NewActors(reg prometheus.Registerer) *Actors {
	m := &Actors{Unexpected: counterVec("actor", "unexpected_messages_total", "Messages an actor had no case for.", "actor")}
	register(reg, m.Unexpected)
	return m
}

func register(reg prometheus.Registerer, cs ...prometheus.Collector) {
	if reg != nil {
		reg.MustRegister(cs...)
	}
}
