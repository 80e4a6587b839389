package cluster

import (
	"errors"
	"fmt"
	"time"
)

// Config holds the cluster settings of one node. The zero value of a field
// means its default (DefaultConfig); Validate fills them in.
type Config struct {
	// Prefix is the NATS subject prefix P (default "kvactors").
	Prefix string `json:"prefix"`
	// Bucket is the ownership KV bucket (default "kvactors_owners").
	Bucket string `json:"bucket"`
	// Replicas of the ownership bucket: 3 on a NATS cluster of 3 or more
	// servers, so it survives one server's loss (default 1, one server).
	Replicas int `json:"replicas"`
	// Lease is the ownership lease: the bucket's max age, so a record not
	// renewed for Lease is removed by the servers. Must be ≥ 1 s (the
	// shortest expiry-marker TTL nats-server accepts). Default 10 s, the
	// node's session lease. Every node of a cluster must use the same.
	Lease time.Duration `json:"lease"`
	// ClockSkew is how far the NATS servers' clocks may run apart, or be
	// stepped or slewed, within a lease: the servers expire an ownership
	// record by the stamp of the server that stored it, and the owner's
	// own head start over that stamp is one trip (tens of µs), so an owner
	// stops serving ClockSkew before a lease from its last write sent.
	// Default Lease/10 (1 s at 10 s: chrony's largest slew over a lease);
	// at most Lease/2.
	ClockSkew time.Duration `json:"clock_skew"`
	// Node and Boot are this node process (node id, boot id).
	Node string `json:"node"`
	Boot string `json:"boot"`
	// StandbyFor names the node this one stands by for ("" none).
	StandbyFor string `json:"standby_for"`
	// FetchWindow is how many fetch pieces a client keeps in flight
	// (default 4).
	FetchWindow int `json:"fetch_window"`
	// FetchTimeout bounds each fetch piece's round trip (default 5 s).
	FetchTimeout time.Duration `json:"fetch_timeout"`
	// MaxChunkBytes is the largest chunk a fetch client accepts, so a
	// hostile or broken peer cannot make it allocate without bound
	// (default 1 GiB).
	MaxChunkBytes int64 `json:"max_chunk_bytes"`
	// MaxPeerKeys bounds the keys the holders index keeps of each other
	// node, so a node announcing an unbounded key set (kv_events or
	// catch-up pages) cannot grow every other node's memory without bound:
	// its keys past the bound are left out, counted and logged (docs/
	// CLUSTER.md, Holders). Default 2^20 (defaultMaxPeerKeys).
	MaxPeerKeys int `json:"max_peer_keys"`
}

// defaultMaxPeerKeys is MaxPeerKeys' default, 2^20 keys: a 1 TiB host pool
// of 1 MiB chunks (the pool's default page), about as much as one host
// holds. Each indexed key costs about 300 bytes (a 36-byte key, measured
// with holders.Index), so a node at the cap costs each other node about
// 300 MiB. A cluster of larger pools or smaller chunks raises it.
const defaultMaxPeerKeys = 1 << 20

// DefaultConfig is the one source of the defaults.
func DefaultConfig() Config {
	return Config{
		Prefix:        "kvactors",
		Bucket:        "kvactors_owners",
		Replicas:      1,
		Lease:         10 * time.Second,
		FetchWindow:   4,
		FetchTimeout:  5 * time.Second,
		MaxChunkBytes: 1 << 30,
		MaxPeerKeys:   defaultMaxPeerKeys,
	}
}

// ServeFor is how long after sending its last successful write an owner
// serves its engine: the lease less the clock skew (ClockSkew).
func (c Config) ServeFor() time.Duration { return c.Lease - c.ClockSkew }

// Errors of Validate.
var ErrConfig = errors.New("cluster: bad config")

// Validate fills in defaults and refuses bad values. A refusal names the
// setting by the kvactors serve flag that gives it (--cluster-replicas 7:
// want 1..5), as the node's own refusals do: an operator sets them there.
func (c *Config) Validate() error {
	d := DefaultConfig()
	if c.Prefix == "" {
		c.Prefix = d.Prefix
	}
	if c.Bucket == "" {
		c.Bucket = d.Bucket
	}
	if c.Replicas == 0 {
		c.Replicas = d.Replicas
	}
	if c.Lease == 0 {
		c.Lease = d.Lease
	}
	if c.ClockSkew == 0 {
		c.ClockSkew = c.Lease / 10
	}
	if c.FetchWindow == 0 {
		c.FetchWindow = d.FetchWindow
	}
	if c.FetchTimeout == 0 {
		c.FetchTimeout = d.FetchTimeout
	}
	if c.MaxChunkBytes == 0 {
		c.MaxChunkBytes = d.MaxChunkBytes
	}
	if c.MaxPeerKeys == 0 {
		c.MaxPeerKeys = d.MaxPeerKeys
	}
	switch {
	case !validBucket(c.Bucket):
		// JetStream's rule, checked here: refused only at the bucket's
		// creation, it read as NATS failing, not as the setting.
		return fmt.Errorf("%w: --cluster-bucket %q: want letters, digits, '-' and '_' only", ErrConfig, c.Bucket)
	case c.Replicas < 1 || c.Replicas > 5:
		return fmt.Errorf("%w: --cluster-replicas %d: want 1..5", ErrConfig, c.Replicas)
	case c.Lease < time.Second:
		return fmt.Errorf("%w: --lease %v: want at least 1s", ErrConfig, c.Lease)
	case c.ClockSkew < 0 || c.ClockSkew > c.Lease/2:
		return fmt.Errorf("%w: --cluster-clock-skew %v: want 0..%v (half --lease)", ErrConfig, c.ClockSkew, c.Lease/2)
	case c.FetchWindow < 1:
		return fmt.Errorf("%w: --fetch-window %d: want >= 1 (0: the default)", ErrConfig, c.FetchWindow)
	case c.FetchTimeout < 0:
		return fmt.Errorf("%w: --fetch-timeout %v: want > 0 (0: the default)", ErrConfig, c.FetchTimeout)
	case c.MaxChunkBytes < 1:
		// No flag gives it (a program's setting): named by its field.
		return fmt.Errorf("%w: Config.MaxChunkBytes %d: want >= 1 (0: the default)", ErrConfig, c.MaxChunkBytes)
	case c.MaxPeerKeys < 1:
		return fmt.Errorf("%w: --cluster-max-peer-keys %d: want >= 1 (0: the default)", ErrConfig, c.MaxPeerKeys)
	}
	return nil
}

// validBucket is JetStream's rule for a KV bucket's name: [A-Za-z0-9_-]+.
func validBucket(name string) bool {
	if name == "" {
		return false
	}
	for _, r := range name {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_':
		default:
			return false
		}
	}
	return true
}
