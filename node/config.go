package node

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/backend/cuda"
	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/cluster"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
)

// Config is every setting of a node. The zero value of a field means its
// default, and every default is in DefaultConfig (withDefaults fills them;
// docs/CONFIG.md lists them); node.Flags binds flags, KVACTORS_* variables
// and the --config file to it.
type Config struct {
	// NATSURL connects to an existing NATS server or cluster; empty starts an
	// embedded server.
	NATSURL string `json:"nats_url"`
	// NATSConnectTimeout bounds the retries (with backoff) of the first
	// connection to NATSURL, so a node started before its NATS cluster waits
	// for it instead of exiting.
	NATSConnectTimeout time.Duration `json:"nats_connect_timeout"`
	// NATSHost and NATSPort are the embedded server's listen address
	// (port -1 picks a free one).
	NATSHost string `json:"nats_host"`
	NATSPort int    `json:"nats_port"`
	// NATSStoreDir is the embedded JetStream directory (default: a temp dir,
	// removed on Close).
	NATSStoreDir string `json:"nats_store_dir"`
	// NATSCreds is a credentials file; NATSUser/NATSPassword or NATSToken
	// authenticate otherwise; NATSCA is a CA bundle for TLS. NATSCert and
	// NATSKey (both or neither) are a client certificate and its key, for a
	// server that verifies clients' certificates (nats-config --tls-ca).
	// TLS is for a server over TCP (NATSURL): the connection to the
	// embedded server is in-process and plain (plainInProcess).
	NATSCreds    string `json:"nats_creds"`
	NATSUser     string `json:"-"`
	NATSPassword string `json:"-"`
	NATSToken    string `json:"-"`
	NATSCA       string `json:"nats_ca"`
	NATSCert     string `json:"nats_cert"`
	NATSKey      string `json:"nats_key"`
	// Prefix is the subject prefix P.
	Prefix string `json:"prefix"`
	// Backend is "shm" or "cuda".
	Backend string `json:"backend"`
	// ShmDir is where shm segments live.
	ShmDir string `json:"shm_dir"`
	// CUDADevice is the device the cuda backend uses.
	CUDADevice int `json:"cuda_device"`
	// PoolBytes is the host pool's size.
	PoolBytes int64 `json:"pool_bytes"`
	// SlotBytes is deprecated and ignored: the pool takes chunks of any size
	// from every engine (see PoolPageBytes). Kept so old command lines and
	// config files still parse; a non-zero value is logged as ignored.
	SlotBytes int64 `json:"slot_bytes"`
	// HTTPAddr is the admin server's address ("off" disables it; port 0 picks a free one, see Node.HTTPAddr).
	HTTPAddr string `json:"http_addr"`
	// DecodeWorkers decode event batches in parallel; one engine's batches
	// always go to the same worker, so they apply in order.
	DecodeWorkers int `json:"decode_workers"`
	// ShutdownTimeout bounds the graceful part of Close; if it
	// expires with releases undelivered, Close returns ErrUndelivered.
	ShutdownTimeout time.Duration `json:"shutdown_timeout"`
	// Pprof serves /debug/pprof on the admin address (default off: profiles
	// expose internals and cost CPU while taken).
	Pprof bool `json:"pprof"`
	// LogLevel (debug, info, warn, error) and LogFormat (text, json) build
	// the logger of NewLogger; a node given Log ignores them.
	LogLevel  string `json:"log_level"`
	LogFormat string `json:"log_format"`
	// NodeID names this node in replies, resyncs and P._node.<id>.* (default:
	// the host name reduced to [A-Za-z0-9_-]).
	NodeID string `json:"node_id"`
	// NodeIDReduce reduces NodeID as the host name is reduced (ReduceNodeID):
	// for an id taken from a name with dots, such as a Kubernetes node
	// name, which a manifest cannot rewrite.
	NodeIDReduce bool `json:"node_id_reduce"`
	// SkipNodeIDCheck skips the start's probe for a running process with
	// the same node id (node/identity.go), for a NATS whose permissions
	// drop the probe's answer. The node still reports one it hears.
	SkipNodeIDCheck bool `json:"skip_node_id_check"`
	// Lease is the engine lease (PROTOCOL.md "Sessions"): node heartbeats
	// every Lease/4, engines expire after Lease without a sign of life,
	// copies wait when NATS has not answered for Lease/2 and the process
	// stops if a copy is still running 5/8 Lease after the last answer.
	Lease time.Duration `json:"lease"`
	// MaxPendingBytes bounds inbound message bytes taken and not yet handled;
	// what does not fit becomes a resync (reason overflow).
	MaxPendingBytes int64 `json:"max_pending_bytes"`
	// KVEventsLinger is how long the kv_events journal lets changes gather
	// after the first before it publishes them (0: the default, 1ms; negative:
	// publish each at once). Routers learn of a change up to this much
	// later; in exchange a lightly loaded node sends one kv_events message
	// per engine per linger instead of one per copy, and wakes once for it.
	KVEventsLinger time.Duration `json:"kv_events_linger"`
	// LoadWait bounds a load's wait for a key another copy is filling
	// (a read-back from disk, a store) before it fails as a miss: below
	// the engines' request timeout (the Go SDK's default is 5s), so a slow
	// copy queue turns a load into a miss, not into a load in doubt.
	// Default 2s; a longer one than lease/2 is cut to it.
	LoadWait time.Duration `json:"load_wait"`
	// FailStop ends the process when fencing demands it (default: log and
	// exit with status 3); tests inject their own.
	FailStop func(reason string) `json:"-"`
	// WrapDevice, when set, wraps each engine's attached device (tests hold
	// or fail copies with it).
	WrapDevice func(backend.Attachment) backend.Attachment `json:"-"`
	// now is the clock of engine liveness (nil: time.Now): when intake
	// drops a sign of life, and what the engine actors stamp and check
	// leases with. Internal tests fake it.
	now func() time.Time
	// kvDeferMost bounds the kv_events changes deferred for namespaces
	// with no member (0: kvDeferMost). Tests set it small.
	kvDeferMost int
	// loadChunksMost bounds the chunks of an engine's loads in flight (0:
	// maxLoadChunks). Tests set it small.
	loadChunksMost int64
	// loadBuilt, when set, is called as a load's chunks are built, with
	// how many and the chunks its engine's loads in flight hold then, its
	// own counted. Tests set it (export_test).
	loadBuilt func(chunks int, held int64)
	// natsExtra is appended to the client's options (nil: none). Tests set
	// it (export_test), e.g. to keep a node on the one server it dials.
	natsExtra []nats.Option
	// embeddedExtra edits the embedded server's options after the start's
	// checks of them (nil: none). Tests set it, e.g. to refuse every
	// connection (max_connections) or name users by certificates.
	embeddedExtra func(*server.Options)
	// Transfer bounds each device's copies.
	Transfer transfer.Config `json:"transfer"`
	// Limits bounds what one message may contain.
	Limits ingest.Limits `json:"limits"`

	// cluster (docs/CLUSTER.md). Clustering is on with Cluster or
	// StandbyFor: the node then needs JetStream (an operator's NATS cluster
	// with --nats, or the embedded server), claims the engines it serves in
	// the ownership bucket, answers lookup and load for chunks held by other
	// nodes, and serves its own chunks over P._node.<node>.fetch. Off, a
	// single node works exactly as without a cluster.
	Cluster bool `json:"cluster"`
	// StandbyFor names the node this one stands by for: it takes that node's
	// engines over once their ownership lease lapses (implies Cluster).
	StandbyFor string `json:"standby_for"`
	// ClusterBucket is the ownership KV bucket (default kvactors_owners).
	ClusterBucket string `json:"cluster_bucket"`
	// ClusterReplicas are the ownership bucket's replicas (default 1; 3 on a
	// NATS cluster of three servers or more).
	ClusterReplicas int `json:"cluster_replicas"`
	// FetchWindow is how many fetch pieces are in flight per remote chunk
	// (default 4); FetchTimeout bounds each piece (default 5s).
	FetchWindow  int           `json:"fetch_window"`
	FetchTimeout time.Duration `json:"fetch_timeout"`
	// ClusterMaxPeerKeys bounds the keys of each other node that this
	// node's holders index keeps (default cluster.DefaultConfig's: 2^20);
	// the keys past it are left out, counted and logged.
	ClusterMaxPeerKeys int `json:"cluster_max_peer_keys"`
	// ClusterClockSkew is how far the NATS servers' clocks may differ, or
	// be stepped or slewed, within a lease: an owner stops serving an
	// engine this long before the servers can expire its claim (0:
	// Lease/10; cluster.Config.ClockSkew).
	ClusterClockSkew time.Duration `json:"cluster_clock_skew"`

	// Log, Tracer and Registry are injected (nil: slog.Default, a no-op
	// tracer, a fresh registry).
	Log      *slog.Logger         `json:"-"`
	Tracer   trace.TracerProvider `json:"-"`
	Registry *prometheus.Registry `json:"-"`

	// isolation (PROTOCOL.md "Isolation", docs/SECURITY.md).
	// MaxEngines bounds the engines registered on this node.
	MaxEngines int `json:"max_engines"`
	// MaxRequests bounds one engine's live requests.
	MaxRequests int `json:"max_requests"`
	// MaxRequestStateBytes bounds the bytes of hashes and block ids one
	// engine's live requests hold together (sched.StateBudget): MaxModelLen
	// bounds each request and MaxRequests their count, but not their
	// product (terabytes at the defaults).
	MaxRequestStateBytes int64 `json:"max_request_state_bytes"`
	// MaxMappedSegments bounds the engine segments mapped on this node at
	// once, so registrations cannot exhaust the process's map count
	// (vm.max_map_count, 65530 by default) for everyone.
	MaxMappedSegments int `json:"max_mapped_segments"`
	// MaxMappedBytes bounds the bytes of engine segments mapped on this
	// node at once: the page-rounded span of each segment that its regions
	// use (only that much is mapped). Sparse shm objects cost an engine
	// nothing, so without it registers could take the process's whole
	// virtual address space, and the next heap growth would kill the node.
	MaxMappedBytes int64 `json:"max_mapped_bytes"`
	// MaxModelLen bounds the tokens one request may hold (hashes and block
	// ids), whatever an engine's spec says: a register whose spec asks for a
	// larger max_model_len is refused ("limit"), and one that gives none
	// (its bound is then num_gpu_blocks × the largest tokens_per_block) is
	// bounded by it instead.
	MaxModelLen int `json:"max_model_len"`
	// NATSConfig is a nats-server configuration file the embedded server
	// loads (auth, TLS, accounts; see kvactors nats-config). Its listen
	// address, when set, wins over NATSHost/NATSPort.
	NATSConfig string `json:"nats_config"`
	// NATSNKey is the nkey seed file the node authenticates to NATS with.
	NATSNKey string `json:"nats_nkey"`
	// pool
	// PoolPageBytes is the pool's page size: pages are handed
	// to chunk sizes as needed, and a chunk larger than a page spans several.
	// A page wastes under 1/16 of itself whatever the chunk sizes.
	PoolPageBytes int64 `json:"pool_page_bytes"`
	// PoolMaxChunks bounds the chunks the pool holds, whatever their size,
	// as PoolBytes bounds their bytes (0: hostpool.DefaultMaxChunks, one
	// per 4 KiB of pool and at least 65536; at most hostpool.MaxChunks).
	// Each chunk costs ~170 bytes of heap, and an engine's spec chooses its
	// chunk size: one-byte chunks would fill a 1 GiB pool with a billion.
	PoolMaxChunks int `json:"pool_max_chunks"`
	// DiskDir turns on the disk tier: chunks evicted from host memory are
	// written there (appended to segment files) instead of vanishing, and the
	// directory is re-indexed at start. Empty: no disk tier (the default).
	DiskDir string `json:"disk_dir"`
	// DiskBytes is the disk tier's budget of chunk bytes (required with
	// DiskDir); past it the least recently used chunks are deleted.
	DiskBytes int64 `json:"disk_bytes"`
	// DiskMaxChunks bounds the chunks the disk tier holds, whatever their
	// size, as DiskBytes bounds their data (0: disk.Open's default, one
	// per 4 KiB of DiskBytes and at least 65536). Each costs its index ~190
	// bytes of heap: one-byte chunks would put ~25M per GiB of budget there.
	DiskMaxChunks int `json:"disk_max_chunks"`
}

// HTTPOff as the admin address disables the admin server.
const HTTPOff = "off"

// Log formats.
const (
	LogText = "text"
	LogJSON = "json"
)

// FailStopExit is the exit status of a fencing fail-stop.
const FailStopExit = 3

// DefaultConfig is every setting's default: the one place they are written
// (withDefaults, the serve flags, `kvactors flags` and docs/CONFIG.md read
// them from here).
func DefaultConfig() Config {
	return Config{
		NATSConnectTimeout: 30 * time.Second,
		NATSHost:           "127.0.0.1",
		NATSPort:           4222,
		Prefix:             "kvactors",
		Backend:            "shm",
		CUDADevice:         cuda.DefaultConfig().Device,
		ShmDir:             shm.DefaultConfig().Dir,
		PoolBytes:          1 << 30,
		HTTPAddr:           "127.0.0.1:9464",
		DecodeWorkers:      2,
		ShutdownTimeout:    10 * time.Second,
		Lease:              10 * time.Second,
		MaxPendingBytes:    256 << 20,
		KVEventsLinger:     time.Millisecond,
		LoadWait:           2 * time.Second,
		// isolation: bounds an 8-GPU host never reaches.
		MaxEngines:  256,
		MaxRequests: 1 << 16,
		// 1 GiB: 1,024 requests of 128k tokens with a 32-byte hash every 16
		// tokens and one group hold about half of it (their lists may reach
		// twice what they use as they double).
		MaxRequestStateBytes: 1 << 30,
		MaxMappedSegments:    4096,
		// 4 TiB: more than the RAM of any host this runs on (a segment that is
		// used is backed by tmpfs, i.e. RAM or swap, so honest engines never
		// come near it), and 1/32 of x86-64's 128 TiB of user address space,
		// which leaves the Go heap, the pool and the thread stacks all the
		// room they could want. Lower it on kernels with a smaller address
		// space (arm64 with 39-bit VAs has 512 GiB).
		MaxMappedBytes: 4 << 40,
		// 1Mi tokens: the longest contexts served today (8× the common 128k),
		// so honest engines are not refused, while one request's hashes and
		// block ids stay bounded (a node serving longer contexts raises it).
		MaxModelLen:   1 << 20,
		PoolPageBytes: hostpool.DefaultPageBytes,
		LogLevel:      "info",
		LogFormat:     LogText,
		Transfer:      transfer.DefaultConfig(),
		Limits:        ingest.DefaultLimits(),
		// cluster: off; the rest are cluster.DefaultConfig's.
		ClusterBucket:      cluster.DefaultConfig().Bucket,
		ClusterReplicas:    cluster.DefaultConfig().Replicas,
		FetchWindow:        cluster.DefaultConfig().FetchWindow,
		FetchTimeout:       cluster.DefaultConfig().FetchTimeout,
		ClusterMaxPeerKeys: cluster.DefaultConfig().MaxPeerKeys,
	}
}

// ErrConfig wraps every configuration error.
var ErrConfig = errors.New("bad config")

// configError is ErrConfig for a package's own configuration error, one
// that already says so (cluster.ErrConfig: "cluster: bad config: …"), so
// that the text does not say "bad config" twice.
type configError struct{ err error }

func (e configError) Error() string   { return e.err.Error() }
func (e configError) Unwrap() []error { return []error{ErrConfig, e.err} }

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	orDefault(&c.NATSConnectTimeout, d.NATSConnectTimeout)
	orDefault(&c.NATSHost, d.NATSHost)
	orDefault(&c.NATSPort, d.NATSPort)
	orDefault(&c.Prefix, d.Prefix)
	orDefault(&c.Backend, d.Backend)
	orDefault(&c.ShmDir, d.ShmDir)
	orDefault(&c.PoolBytes, d.PoolBytes)
	orDefault(&c.HTTPAddr, d.HTTPAddr)
	orDefault(&c.DecodeWorkers, d.DecodeWorkers)
	orDefault(&c.ShutdownTimeout, d.ShutdownTimeout)
	orDefault(&c.LogLevel, d.LogLevel)
	orDefault(&c.LogFormat, d.LogFormat)
	orDefault(&c.Lease, d.Lease)
	orDefault(&c.MaxPendingBytes, d.MaxPendingBytes)
	orDefault(&c.KVEventsLinger, d.KVEventsLinger)
	orDefault(&c.LoadWait, d.LoadWait)
	c.LoadWait = min(c.LoadWait, c.Lease/2)
	if c.NodeIDReduce && c.NodeID != "" {
		c.NodeID = ReduceNodeID(c.NodeID)
	}
	if c.NodeID == "" { // not in DefaultConfig: it depends on the host
		c.NodeID = DefaultNodeID()
	}
	c.Limits = c.Limits.WithDefaults()
	orDefault(&c.MaxEngines, d.MaxEngines)
	orDefault(&c.MaxRequests, d.MaxRequests)
	orDefault(&c.MaxRequestStateBytes, d.MaxRequestStateBytes)
	orDefault(&c.MaxMappedSegments, d.MaxMappedSegments)
	orDefault(&c.MaxMappedBytes, d.MaxMappedBytes)
	orDefault(&c.MaxModelLen, d.MaxModelLen)
	orDefault(&c.PoolPageBytes, d.PoolPageBytes)
	if c.PoolMaxChunks == 0 { // not in DefaultConfig: it depends on PoolBytes
		c.PoolMaxChunks = hostpool.DefaultMaxChunks(c.PoolBytes)
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.Registry == nil {
		c.Registry = prometheus.NewRegistry()
	}
	if c.FailStop == nil {
		log := c.Log
		c.FailStop = func(reason string) {
			log.Error("fail-stop: ending the process", "reason", reason)
			os.Exit(FailStopExit)
		}
	}
	return c
}

// orDefault sets a zero *v to def (the zero value of a setting means its
// default).
func orDefault[T comparable](v *T, def T) {
	var zero T
	if *v == zero {
		*v = def
	}
}

// maxPrefixBytes bounds --prefix: with the engine id, verb and a reply
// inbox, a subject and reply stay well within MaxControlLine.
const maxPrefixBytes = 256

// maxCopyWorkers bounds --copy-workers: copies running at once on one
// device, each a memcpy on a core (shm) or a DMA (cuda); more than a host
// has cores buys nothing, and --max-inflight-bytes bounds their bytes.
const maxCopyWorkers = 256

// Validate reports the first bad setting, named by its flag as the user
// typed it, in one style: '--pool-bytes -1: want …' (an exit-2 error that
// named a field left the operator to guess which flag it meant).
func (c Config) Validate() error {
	c = c.withDefaults()
	switch {
	case c.Backend != "shm" && c.Backend != "cuda":
		return fmt.Errorf("%w: --backend %q: want shm or cuda", ErrConfig, c.Backend)
	case c.PoolBytes < 0:
		return fmt.Errorf("%w: --pool-bytes %d: want > 0 (0: the default)", ErrConfig, c.PoolBytes)
	case c.PoolPageBytes < 0:
		return fmt.Errorf("%w: --pool-page-bytes %d: want > 0 (0: the default)", ErrConfig, c.PoolPageBytes)
	case c.PoolBytes/min(c.PoolPageBytes, hostpool.MaxPageBytes) > hostpool.MaxPages:
		return fmt.Errorf("%w: --pool-bytes %d in pages of %d (--pool-page-bytes) is more than %d pages: raise --pool-page-bytes",
			ErrConfig, c.PoolBytes, c.PoolPageBytes, hostpool.MaxPages)
	case c.PoolMaxChunks < 0 || c.PoolMaxChunks > hostpool.MaxChunks:
		return fmt.Errorf("%w: --pool-max-chunks %d: want 1..%d (0: the default)", ErrConfig, c.PoolMaxChunks,
			hostpool.MaxChunks)
	case c.DiskMaxChunks < 0:
		return fmt.Errorf("%w: --disk-max-chunks %d: want >= 1 (0: the default)", ErrConfig, c.DiskMaxChunks)
	case c.DiskBytes < 0 || (c.DiskDir != "" && c.DiskBytes == 0):
		return fmt.Errorf("%w: --disk-bytes %d: want > 0 with --disk-dir", ErrConfig, c.DiskBytes)
	case c.Transfer.Workers < 0:
		// transfer.Config reads any count below 1 as its default: a
		// negative one would start the node with 2 workers unseen.
		return fmt.Errorf("%w: --copy-workers %d: want 1..%d (0: the default)", ErrConfig, c.Transfer.Workers, maxCopyWorkers)
	case c.Transfer.Workers > maxCopyWorkers:
		// Each is a goroutine started with the node: a typo's billion
		// would exhaust memory rather than fail.
		return fmt.Errorf("%w: --copy-workers %d: want 1..%d", ErrConfig, c.Transfer.Workers, maxCopyWorkers)
	case c.Transfer.MaxInFlightBytes < 0: // as for a negative --copy-workers
		return fmt.Errorf("%w: --max-inflight-bytes %d: want > 0 (0: the default)", ErrConfig, c.Transfer.MaxInFlightBytes)
	case c.DecodeWorkers < 1 || c.DecodeWorkers > 256:
		return fmt.Errorf("%w: --decode-workers %d: want 1..256", ErrConfig, c.DecodeWorkers)
	case len(c.Prefix) > maxPrefixBytes:
		return fmt.Errorf("%w: --prefix of %d bytes: want at most %d (subjects and replies fit a %d-byte control line)",
			ErrConfig, len(c.Prefix), maxPrefixBytes, MaxControlLine)
	case !messages.ValidPrefix(c.Prefix):
		return fmt.Errorf("%w: --prefix %q: want dot-separated tokens without wildcards or spaces, not starting with _ or $", ErrConfig, c.Prefix)
	case c.NATSPort < -1 || c.NATSPort > 65535:
		return fmt.Errorf("%w: --nats-port %d: want 1..65535 (-1: any free port; 0: the default)", ErrConfig, c.NATSPort)
	case c.NATSConnectTimeout < 0:
		return fmt.Errorf("%w: --nats-connect-timeout %v: want > 0 (0: the default)", ErrConfig, c.NATSConnectTimeout)
	case c.ShutdownTimeout < 0:
		return fmt.Errorf("%w: --shutdown-timeout %v: want > 0 (0: the default)", ErrConfig, c.ShutdownTimeout)
	case !ingest.ValidEngineID(c.NodeID):
		return fmt.Errorf("%w: --node-id %q: want [A-Za-z0-9_-]{1,64}, not starting with _", ErrConfig, c.NodeID)
	case c.Lease < 40*time.Millisecond:
		return fmt.Errorf("%w: --lease %v: want at least 40ms", ErrConfig, c.Lease)
	case c.MaxPendingBytes < 4096:
		return fmt.Errorf("%w: --max-pending-bytes %d: want at least 4096", ErrConfig, c.MaxPendingBytes)
	case c.LoadWait < 0:
		return fmt.Errorf("%w: --load-wait %v: want > 0", ErrConfig, c.LoadWait)
	case c.KVEventsLinger > time.Second:
		return fmt.Errorf("%w: --kv-events-linger %v: want at most 1s (negative: none)", ErrConfig, c.KVEventsLinger)
	case c.MaxEngines < 1:
		return fmt.Errorf("%w: --max-engines %d: want >= 1 (0: the default)", ErrConfig, c.MaxEngines)
	case c.MaxRequests < 1:
		return fmt.Errorf("%w: --max-requests %d: want >= 1 (0: the default)", ErrConfig, c.MaxRequests)
	case c.MaxRequestStateBytes < 1:
		return fmt.Errorf("%w: --max-request-state-bytes %d: want >= 1 (0: the default)", ErrConfig, c.MaxRequestStateBytes)
	case c.MaxMappedSegments < 1:
		return fmt.Errorf("%w: --max-mapped-segments %d: want >= 1 (0: the default)", ErrConfig, c.MaxMappedSegments)
	case c.MaxMappedBytes < 1:
		return fmt.Errorf("%w: --max-mapped-bytes %d: want >= 1 (0: the default)", ErrConfig, c.MaxMappedBytes)
	case c.MaxModelLen < 1:
		return fmt.Errorf("%w: --max-model-len %d: want >= 1 (0: the default)", ErrConfig, c.MaxModelLen)
	case c.NATSConfig != "" && c.NATSURL != "":
		return fmt.Errorf("%w: --nats-config configures the embedded server; with --nats there is none", ErrConfig)
	case c.StandbyFor != "" && (!ingest.ValidEngineID(c.StandbyFor) || c.StandbyFor == c.NodeID):
		return fmt.Errorf("%w: --standby-for %q: want another node's id", ErrConfig, c.StandbyFor)
	case c.Clustered() && c.Lease < time.Second:
		return fmt.Errorf("%w: --lease %v: a cluster needs at least 1s (the ownership bucket's expiry)", ErrConfig, c.Lease)
	}
	if err := c.checkAddresses(); err != nil {
		return err
	}
	if c.Clustered() {
		cc := c.clusterConfig("")
		if err := cc.Validate(); err != nil {
			return configError{err}
		}
	}
	if _, err := c.NewLogger(io.Discard); err != nil {
		return err
	}
	if err := c.Limits.Validate(); err != nil {
		var bad *ingest.LimitError
		if errors.As(err, &bad) && limitFlags[bad.Field] != "" {
			return fmt.Errorf("%w: %s %d: want 1..%d (0: the default)", ErrConfig, limitFlags[bad.Field], bad.Value, bad.Max)
		}
		return fmt.Errorf("%w: %w", ErrConfig, err) // one no flag gives: a program's, named by its field
	}
	return nil
}

// natsTLS reports whether the NATS client's TLS files (--nats-ca,
// --nats-cert, --nats-key) are used: with --nats only. The node's
// connection to its embedded server is in-process and plain
// (plainInProcess); its credentials (--nats-creds, --nats-nkey) are used
// either way.
func (c Config) natsTLS() bool { return c.NATSURL != "" }

// limitFlags are the flags of the ingest limits BindFlags gives one, by
// the limit's JSON name (ingest.LimitError.Field).
var limitFlags = map[string]string{"max_ids": "--max-ids", "max_groups": "--max-groups"}

// CheckFiles checks that the NATS secret files c names (--nats-creds,
// --nats-ca, --nats-nkey, --nats-cert with --nats-key) can be read and hold what they should
// (checkSecretFile); the error wraps ErrConfig and names
// the flag. A wrong path would otherwise only show at connect time, retried
// for the whole --nats-connect-timeout as "nats not reachable" and exiting
// 1, which systemd restarts for ever; a config error exits 2. Apart from
// Validate, which reads no file (a config can be checked away from its
// host); Start calls both. The TLS files are checked only where they are
// used (natsTLS): without --nats they are ignored, with a warning.
func (c Config) CheckFiles() error {
	files := []struct{ flag, path string }{{"--nats-creds", c.NATSCreds}, {"--nats-nkey", c.NATSNKey}}
	if c.natsTLS() {
		files = append(files, struct{ flag, path string }{"--nats-ca", c.NATSCA})
	}
	for _, f := range files {
		if err := checkSecretFile(f.flag, f.path); err != nil {
			return fmt.Errorf("%w: %s: %w", ErrConfig, f.flag, err)
		}
	}
	if !c.natsTLS() {
		return nil
	}
	if (c.NATSCert == "") != (c.NATSKey == "") {
		return fmt.Errorf("%w: --nats-cert and --nats-key go together (a client certificate and its key)", ErrConfig)
	}
	if c.NATSCert != "" {
		if _, err := tls.LoadX509KeyPair(c.NATSCert, c.NATSKey); err != nil {
			return fmt.Errorf("%w: --nats-cert %s, --nats-key %s: %w", ErrConfig, c.NATSCert, c.NATSKey, err)
		}
	}
	return nil
}

// readFile reads path, a regular file (not a directory) this process can
// open.
func readFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	if st.IsDir() {
		return nil, fmt.Errorf("%s is a directory", path)
	}
	return io.ReadAll(f)
}

// DefaultNodeID is the host name reduced to a node id (ReduceNodeID).
func DefaultNodeID() string {
	host, _ := os.Hostname()
	return ReduceNodeID(host)
}

// ReduceNodeID keeps the characters of name a node id may hold
// ([A-Za-z0-9_-], at most 64 bytes, a leading _ dropped), or is "kvactors"
// when nothing is left: "ip-10-0-1-23.ec2.internal" is
// "ip-10-0-1-23ec2internal".
func ReduceNodeID(name string) string {
	id := make([]byte, 0, min(len(name), 64))
	for i := 0; i < len(name) && len(id) < 64; i++ {
		switch ch := name[i]; {
		case 'a' <= ch && ch <= 'z', 'A' <= ch && ch <= 'Z', '0' <= ch && ch <= '9', ch == '-':
			id = append(id, ch)
		case ch == '_' && len(id) > 0:
			id = append(id, ch)
		}
	}
	if len(id) == 0 {
		return "kvactors"
	}
	return string(id)
}

// NewLogger is the logger LogLevel and LogFormat describe, writing to w.
func (c Config) NewLogger(w io.Writer) (*slog.Logger, error) {
	c = c.withDefaults()
	var l slog.Level
	if err := l.UnmarshalText([]byte(c.LogLevel)); err != nil {
		return nil, fmt.Errorf("%w: --log-level %q: want debug, info, warn or error", ErrConfig, c.LogLevel)
	}
	opts := &slog.HandlerOptions{Level: l}
	switch c.LogFormat {
	case LogText:
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case LogJSON:
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("%w: --log-format %q: want %s or %s", ErrConfig, c.LogFormat, LogText, LogJSON)
}
