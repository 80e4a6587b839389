package node

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/ingest"
)

// Config is every setting of a node. The zero value of a field means its
// default (withDefaults); cmd/kvactors binds flags and KVACTORS_* variables
// to it (docs/CONFIG.md).
type Config struct {
	// NATSURL connects to an existing NATS server or cluster; empty starts an
	// embedded server.
	NATSURL string `json:"nats_url"`
	// NATSHost and NATSPort are the embedded server's listen address
	// (default 127.0.0.1:4222; port -1 picks a free one).
	NATSHost string `json:"nats_host"`
	NATSPort int    `json:"nats_port"`
	// NATSStoreDir is the embedded JetStream directory (default: a temp dir,
	// removed on Close).
	NATSStoreDir string `json:"nats_store_dir"`
	// NATSCreds is a credentials file; NATSUser/NATSPassword or NATSToken
	// authenticate otherwise; NATSCA is a CA bundle for TLS.
	NATSCreds    string `json:"nats_creds"`
	NATSUser     string `json:"-"`
	NATSPassword string `json:"-"`
	NATSToken    string `json:"-"`
	NATSCA       string `json:"nats_ca"`
	// Prefix is the subject prefix P (default "kvactors").
	Prefix string `json:"prefix"`
	// Backend is "shm" (default) or "cuda".
	Backend string `json:"backend"`
	// ShmDir is where shm segments live (default /dev/shm).
	ShmDir string `json:"shm_dir"`
	// CUDADevice is the device the cuda backend uses (default 0).
	CUDADevice int `json:"cuda_device"`
	// PoolBytes is the host pool's size (default 1 GiB).
	PoolBytes int64 `json:"pool_bytes"`
	// SlotBytes is deprecated and ignored: the pool takes chunks of any size
	// from every engine (see PoolPageBytes). Kept so old command lines and
	// config files still parse; a non-zero value is logged as ignored.
	SlotBytes int64 `json:"slot_bytes"`
	// HTTPAddr is the admin server's address (default 127.0.0.1:9464;
	// "off" disables it; port 0 picks a free one, see Node.HTTPAddr).
	HTTPAddr string `json:"http_addr"`
	// DecodeWorkers decode event batches in parallel; one engine's batches
	// always go to the same worker, so they apply in order (default 2).
	DecodeWorkers int `json:"decode_workers"`
	// ShutdownTimeout bounds the graceful part of Close (default 10s).
	ShutdownTimeout time.Duration `json:"shutdown_timeout"`
	// Transfer bounds each device's copies.
	Transfer transfer.Config `json:"transfer"`
	// Limits bounds what one message may contain.
	Limits ingest.Limits `json:"limits"`

	// Log, Tracer and Registry are injected (nil: slog.Default, a no-op
	// tracer, a fresh registry).
	Log      *slog.Logger         `json:"-"`
	Tracer   trace.TracerProvider `json:"-"`
	Registry *prometheus.Registry `json:"-"`

	// pool
	// PoolPageBytes is the pool's page size (default 1 MiB): pages are handed
	// to chunk sizes as needed, and a chunk larger than a page spans several.
	// A page wastes under 1/16 of itself whatever the chunk sizes.
	PoolPageBytes int64 `json:"pool_page_bytes"`
	// DiskDir turns on the disk tier: chunks evicted from host memory are
	// written there (one file per chunk) instead of vanishing, and the
	// directory is re-indexed at start. Empty: no disk tier (the default).
	DiskDir string `json:"disk_dir"`
	// DiskBytes is the disk tier's budget of chunk bytes (required with
	// DiskDir); past it the least recently used chunks are deleted.
	DiskBytes int64 `json:"disk_bytes"`
}

// Defaults.
const (
	DefaultPrefix    = "kvactors"
	DefaultNATSHost  = "127.0.0.1"
	DefaultNATSPort  = 4222
	DefaultShmDir    = "/dev/shm"
	DefaultPoolBytes = 1 << 30
	DefaultHTTPAddr  = "127.0.0.1:9464"
	// HTTPOff disables the admin server.
	HTTPOff = "off"
)

// ErrConfig wraps every configuration error.
var ErrConfig = errors.New("bad config")

func (c Config) withDefaults() Config {
	if c.NATSHost == "" {
		c.NATSHost = DefaultNATSHost
	}
	if c.NATSPort == 0 {
		c.NATSPort = DefaultNATSPort
	}
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.Backend == "" {
		c.Backend = "shm"
	}
	if c.ShmDir == "" {
		c.ShmDir = DefaultShmDir
	}
	if c.PoolBytes == 0 {
		c.PoolBytes = DefaultPoolBytes
	}
	if c.HTTPAddr == "" {
		c.HTTPAddr = DefaultHTTPAddr
	}
	if c.DecodeWorkers == 0 {
		c.DecodeWorkers = 2
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = 10 * time.Second
	}
	c.Limits = c.Limits.WithDefaults()
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.Registry == nil {
		c.Registry = prometheus.NewRegistry()
	}
	return c
}

// Validate reports the first bad setting.
func (c Config) Validate() error {
	c = c.withDefaults()
	switch {
	case c.Backend != "shm" && c.Backend != "cuda":
		return fmt.Errorf("%w: backend %q: want shm or cuda", ErrConfig, c.Backend)
	case c.PoolBytes < 0:
		return fmt.Errorf("%w: pool bytes %d < 0", ErrConfig, c.PoolBytes)
	case c.PoolPageBytes < 0:
		return fmt.Errorf("%w: pool page bytes %d < 0", ErrConfig, c.PoolPageBytes)
	case c.DiskBytes < 0 || (c.DiskDir != "" && c.DiskBytes == 0):
		return fmt.Errorf("%w: disk bytes %d: want > 0 with a disk dir", ErrConfig, c.DiskBytes)
	case c.DecodeWorkers < 1 || c.DecodeWorkers > 256:
		return fmt.Errorf("%w: decode workers %d: want 1..256", ErrConfig, c.DecodeWorkers)
	case !validPrefix(c.Prefix):
		return fmt.Errorf("%w: prefix %q: want dot-separated tokens without wildcards or spaces", ErrConfig, c.Prefix)
	case c.NATSPort < -1 || c.NATSPort > 65535:
		return fmt.Errorf("%w: nats port %d", ErrConfig, c.NATSPort)
	}
	if err := c.Limits.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return nil
}

func validPrefix(p string) bool {
	if p == "" || p[0] == '.' || p[len(p)-1] == '.' {
		return false
	}
	for i := 0; i < len(p); i++ {
		switch ch := p[i]; {
		case ch == '*' || ch == '>' || ch <= ' ' || ch == 0x7f:
			return false
		case ch == '.' && p[i-1] == '.':
			return false
		}
	}
	return true
}
