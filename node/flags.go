package node

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/kvactors/kvactors/hostpool"
)

// Flag is one serve flag: its name, the environment variable that supplies
// its default, the built-in default and what it does. Flags beat their
// KVACTORS_* variable, which beats the default.
type Flag struct {
	Name, Env, Default, Usage string
}

// BindFlags registers every Config flag on fs. A KVACTORS_* variable that is
// set replaces the default (so --help shows the effective value); a malformed
// one is an error naming it.
func (c *Config) BindFlags(fs *flag.FlagSet) ([]Flag, error) {
	var flags []Flag
	var firstErr error
	env := func(name, def, usage string) (string, string) {
		key := "KVACTORS_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
		flags = append(flags, Flag{Name: name, Env: key, Default: def, Usage: usage})
		if v, ok := os.LookupEnv(key); ok {
			return v, key
		}
		return def, ""
	}
	str := func(p *string, name, def, usage string) {
		v, _ := env(name, def, usage)
		fs.StringVar(p, name, v, usage)
	}
	num := func(p *int, name string, def int, usage string) {
		v, key := env(name, strconv.Itoa(def), usage)
		n, err := strconv.Atoi(v)
		if err != nil && firstErr == nil {
			firstErr = fmt.Errorf("%w: %s=%q: %v", ErrConfig, key, v, err)
		}
		fs.IntVar(p, name, n, usage)
	}
	size := func(p *int64, name string, def int64, usage string) {
		v, key := env(name, strconv.FormatInt(def, 10), usage)
		n, err := ParseBytes(v)
		if err != nil && firstErr == nil {
			firstErr = fmt.Errorf("%w: %s=%q: %v", ErrConfig, key, v, err)
		}
		*p = n
		fs.Func(name, usage+fmt.Sprintf(" (bytes; k/M/G suffixes; default %s)", v), func(s string) error {
			n, err := ParseBytes(s)
			*p = n
			return err
		})
	}
	dur := func(p *time.Duration, name string, def time.Duration, usage string) {
		v, key := env(name, def.String(), usage)
		d, err := time.ParseDuration(v)
		if err != nil && firstErr == nil {
			firstErr = fmt.Errorf("%w: %s=%q: %v", ErrConfig, key, v, err)
		}
		fs.DurationVar(p, name, d, usage)
	}
	str(&c.NATSURL, "nats", "", "NATS server or cluster URL(s); empty starts an embedded server")
	str(&c.NATSHost, "nats-host", DefaultNATSHost, "embedded NATS listen host")
	num(&c.NATSPort, "nats-port", DefaultNATSPort, "embedded NATS listen port (-1: any free port)")
	str(&c.NATSStoreDir, "nats-store-dir", "", "embedded JetStream directory, used only when --nats-config enables JetStream (default: a temp dir)")
	str(&c.NATSCreds, "nats-creds", "", "NATS credentials file")
	str(&c.NATSCA, "nats-ca", "", "CA bundle for NATS TLS")
	str(&c.Prefix, "prefix", DefaultPrefix, "subject prefix P of P.<engine>.<verb>")
	str(&c.Backend, "backend", "shm", "device backend: shm, or cuda (binary built with -tags cuda)")
	str(&c.ShmDir, "shm-dir", DefaultShmDir, "directory of engines' shared-memory segments")
	num(&c.CUDADevice, "cuda-device", 0, "CUDA device ordinal for the cuda backend")
	size(&c.PoolBytes, "pool-bytes", DefaultPoolBytes, "host pool size")
	size(&c.SlotBytes, "slot-bytes", 0, "deprecated, ignored: the pool takes any chunk size (see --pool-page-bytes)")
	str(&c.HTTPAddr, "http", DefaultHTTPAddr, "admin HTTP address (/metrics, /healthz, /readyz, /debug/engines); off disables")
	num(&c.DecodeWorkers, "decode-workers", 2, "goroutines decoding event batches")
	num(&c.Transfer.Workers, "copy-workers", 2, "copies running at once per device")
	size(&c.Transfer.MaxInFlightBytes, "max-inflight-bytes", 256<<20, "bytes of copies in flight per device")
	num(&c.Limits.MaxIDs, "max-ids", 1<<20, "most hashes or block ids in one event")
	num(&c.Limits.MaxGroups, "max-groups", 64, "most KV-cache groups per engine")
	dur(&c.ShutdownTimeout, "shutdown-timeout", DefaultShutdownTimeout,
		"bound on graceful shutdown; expiring with releases undelivered exits non-zero")
	str(&c.NodeID, "node-id", "", "this node's id in replies and P._node.<id>.*; empty: the host name reduced to [A-Za-z0-9_-]")
	dur(&c.Lease, "lease", DefaultLease, "engine lease: node heartbeats every lease/4, silent engines expire after it, copies fence at lease/2")
	size(&c.MaxPendingBytes, "max-pending-bytes", DefaultMaxPendingBytes, "bound on inbound message bytes queued (at least 4 × the NATS max payload); beyond it batches are dropped and resynced")
	// isolation
	num(&c.MaxEngines, "max-engines", DefaultMaxEngines, "most engines registered on this node")
	num(&c.MaxRequests, "max-requests", DefaultMaxRequests, "most live requests per engine")
	num(&c.MaxMappedSegments, "max-mapped-segments", DefaultMaxMappedSegments, "most engine segments mapped on this node")
	str(&c.NATSConfig, "nats-config", "", "nats-server config file for the embedded server (auth, TLS, accounts; see kvactors nats-config)")
	str(&c.NATSNKey, "nats-nkey", "", "nkey seed file kvactors authenticates to NATS with")
	// pool
	size(&c.PoolPageBytes, "pool-page-bytes", hostpool.DefaultPageBytes,
		"pool page size: pages go to chunk sizes as needed; a chunk may span pages")
	str(&c.DiskDir, "disk-dir", "", "disk tier directory: chunks evicted from host memory go there; empty: no disk tier")
	size(&c.DiskBytes, "disk-bytes", 0, "disk tier budget (required with --disk-dir)")
	// Secrets come from the environment only, never a flag (ps would show them).
	c.NATSUser, c.NATSPassword, c.NATSToken = os.Getenv("NATS_USER"), os.Getenv("NATS_PASSWORD"), os.Getenv("NATS_TOKEN")
	return flags, firstErr
}

// WriteFlagTable writes the Markdown table of flags (docs/CONFIG.md).
func WriteFlagTable(w io.Writer, flags []Flag) {
	fmt.Fprintln(w, "| flag | environment | default | meaning |")
	fmt.Fprintln(w, "|---|---|---|---|")
	for _, f := range flags {
		def := f.Default
		if def == "" {
			def = `""`
		}
		fmt.Fprintf(w, "| `--%s` | `%s` | `%s` | %s |\n", f.Name, f.Env, def, f.Usage)
	}
}

// ParseBytes parses 1024, 64k, 512KiB, 1G, 1GiB (binary multiples).
func ParseBytes(s string) (int64, error) {
	t := strings.TrimSpace(s)
	mult := int64(1)
	lower := strings.ToLower(t)
	for _, suf := range []struct {
		s string
		m int64
	}{{"kib", 1 << 10}, {"mib", 1 << 20}, {"gib", 1 << 30}, {"tib", 1 << 40},
		{"k", 1 << 10}, {"m", 1 << 20}, {"g", 1 << 30}, {"t", 1 << 40}, {"b", 1}} {
		if strings.HasSuffix(lower, suf.s) {
			mult, t = suf.m, t[:len(t)-len(suf.s)]
			break
		}
	}
	n, err := strconv.ParseInt(strings.TrimSpace(t), 10, 64)
	if err != nil || n < 0 || n > (1<<62)/mult {
		return 0, fmt.Errorf("bad byte size %q", s)
	}
	return n * mult, nil
}
