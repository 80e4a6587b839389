package node

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Flag is one serve flag: its name, the environment variable that supplies
// it when the flag is not given, the built-in default and what it does.
type Flag struct {
	Name, Env, Default, Usage string
}

// ErrUsage wraps command-line mistakes: an unknown flag, a malformed flag
// value, a stray argument.
var ErrUsage = errors.New("bad usage")

// Flags is the serve flag set bound to a Config. Parse resolves every
// setting from, in order of precedence: the flag, its KVACTORS_* variable,
// the --config file, the default (DefaultConfig).
type Flags struct {
	// List is every flag in registration order (docs/CONFIG.md's table).
	List []Flag
	// Warnings are settings that were given but mean nothing together
	// (filled by Parse; the caller logs them).
	Warnings []string

	cfg        *Config
	fs         *flag.FlagSet
	configFile string
}

// unusedSettings are settings that mean nothing unless another is given:
// each given one is warned about when unused says why it is unused ("":
// it is used).
var unusedSettings = []struct {
	names  []string
	unused func(*Config) string
}{
	{[]string{"nats-host", "nats-port", "nats-store-dir"}, func(c *Config) string { // the embedded server's
		if c.NATSURL == "" {
			return ""
		}
		return "--nats " + c.NATSURL + " is an external server, no embedded one starts"
	}},
	{[]string{"nats-ca", "nats-cert", "nats-key"}, func(c *Config) string { // TLS over TCP only
		if c.natsTLS() {
			return ""
		}
		return "the node's connection to its embedded server is in-process, without TLS (they are for --nats)"
	}},
	{[]string{"cluster-bucket", "cluster-replicas", "fetch-window", "fetch-timeout", "cluster-max-peer-keys", "cluster-clock-skew"},
		func(c *Config) string {
			if c.Clustered() {
				return ""
			}
			return "the node is not clustered (no --cluster or --standby-for)"
		}},
	{[]string{"disk-bytes", "disk-max-chunks"}, func(c *Config) string {
		if c.DiskDir != "" {
			return ""
		}
		return "no disk tier without --disk-dir"
	}},
}

// configFlag names the config file; it is itself a flag or a variable,
// never a key of the file.
const configFlag = "config"

// EnvName is the KVACTORS_* variable of a flag.
func EnvName(flagName string) string {
	return "KVACTORS_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// BindFlags registers every Config flag on fs, each with its default from
// DefaultConfig; call Parse on the result. A flag added here appears in
// `kvactors flags`, docs/CONFIG.md, the environment and the config file.
func (c *Config) BindFlags(fs *flag.FlagSet) *Flags {
	d := DefaultConfig()
	f := &Flags{cfg: c, fs: fs}
	add := func(name, def, usage string) {
		f.List = append(f.List, Flag{Name: name, Env: EnvName(name), Default: def, Usage: usage})
	}
	str := func(p *string, name, def, usage string) {
		add(name, def, usage)
		fs.StringVar(p, name, def, usage)
	}
	num := func(p *int, name string, def int, usage string) {
		add(name, strconv.Itoa(def), usage)
		fs.IntVar(p, name, def, usage)
	}
	size := func(p *int64, name string, def int64, usage string) {
		add(name, FormatBytes(def), usage)
		*p = def
		fs.Var((*bytesValue)(p), name, usage+" (bytes; k/M/G/T suffixes)")
	}
	dur := func(p *time.Duration, name string, def time.Duration, usage string) {
		add(name, def.String(), usage)
		fs.DurationVar(p, name, def, usage)
	}
	boolean := func(p *bool, name string, def bool, usage string) {
		add(name, strconv.FormatBool(def), usage)
		fs.BoolVar(p, name, def, usage)
	}
	str(&f.configFile, configFlag, "", "YAML file of settings keyed by flag name (pool-bytes: 8GiB); flags and KVACTORS_* beat it")
	str(&c.NATSURL, "nats", d.NATSURL, "NATS server or cluster URL(s), comma-separated, without credentials (those come from NATS_USER, NATS_PASSWORD, NATS_TOKEN); empty starts an embedded server")
	dur(&c.NATSConnectTimeout, "nats-connect-timeout", d.NATSConnectTimeout, "with --nats, how long to retry the first connection (with backoff) before giving up")
	str(&c.NATSHost, "nats-host", d.NATSHost, "embedded NATS listen host")
	num(&c.NATSPort, "nats-port", d.NATSPort, "embedded NATS listen port (-1: any free port)")
	str(&c.NATSStoreDir, "nats-store-dir", d.NATSStoreDir, "embedded JetStream directory, used only when --nats-config enables JetStream or the node is clustered (default: a temp dir)")
	str(&c.NATSCreds, "nats-creds", d.NATSCreds, "NATS credentials file")
	str(&c.NATSCA, "nats-ca", d.NATSCA, "with --nats, CA bundle for NATS TLS")
	str(&c.NATSCert, "nats-cert", d.NATSCert, "with --nats, client certificate for NATS TLS, for a server that verifies clients' (nats-config --tls-ca; with --nats-key)")
	str(&c.NATSKey, "nats-key", d.NATSKey, "the --nats-cert certificate's key file")
	str(&c.Prefix, "prefix", d.Prefix, "subject prefix P of P.<engine>.<verb> (dot-separated tokens, at most 256 bytes; not starting with _ or $, which NATS reserves)")
	str(&c.Backend, "backend", d.Backend, "device backend: shm, or cuda (binary built with -tags cuda)")
	str(&c.ShmDir, "shm-dir", d.ShmDir, "directory of engines' shared-memory segments")
	num(&c.CUDADevice, "cuda-device", d.CUDADevice, "CUDA device ordinal for the cuda backend")
	size(&c.PoolBytes, "pool-bytes", d.PoolBytes, "host pool size")
	size(&c.SlotBytes, "slot-bytes", d.SlotBytes, "deprecated, ignored: the pool takes any chunk size (see --pool-page-bytes)")
	str(&c.HTTPAddr, "http", d.HTTPAddr, "admin HTTP address (/metrics, /healthz, /readyz, /debug/engines); off disables")
	boolean(&c.Pprof, "pprof", d.Pprof, "serve /debug/pprof on the admin address")
	num(&c.DecodeWorkers, "decode-workers", d.DecodeWorkers, "goroutines decoding event batches (1..256)")
	num(&c.Transfer.Workers, "copy-workers", d.Transfer.Workers, "copies running at once per device (1..256)")
	size(&c.Transfer.MaxInFlightBytes, "max-inflight-bytes", d.Transfer.MaxInFlightBytes, "bytes of copies in flight per device")
	c.Limits = d.Limits // the limits without a flag keep their defaults
	num(&c.Limits.MaxIDs, "max-ids", d.Limits.MaxIDs, "most hashes or block ids in one event")
	num(&c.Limits.MaxGroups, "max-groups", d.Limits.MaxGroups, "most KV-cache groups per engine")
	dur(&c.ShutdownTimeout, "shutdown-timeout", d.ShutdownTimeout,
		"bound on graceful shutdown; expiring with releases undelivered exits non-zero")
	str(&c.NodeID, "node-id", d.NodeID, "this node's id in replies and P._node.<id>.*; empty: the host name reduced to [A-Za-z0-9_-]")
	boolean(&c.NodeIDReduce, "node-id-reduce", d.NodeIDReduce, "reduce --node-id as the host name is: keep [A-Za-z0-9_-], at most 64 bytes (for an id from a name with dots, such as a Kubernetes node name)")
	boolean(&c.SkipNodeIDCheck, "skip-node-id-check", d.SkipNodeIDCheck, "start without asking whether another running process serves this node id (it is still reported if heard)")
	dur(&c.Lease, "lease", d.Lease, "engine lease: node heartbeats every lease/4, silent engines expire after it, copies fence at lease/2, and 3/4 without a NATS round trip is a lapse (old sessions never copy again); client.Dial's pings close a dead link in 6s, enough only for a lease over 8s: for a shorter one engines must pass a shorter nats.PingInterval")
	size(&c.MaxPendingBytes, "max-pending-bytes", d.MaxPendingBytes, "bound on inbound message bytes queued (at least 4 × the NATS max payload); beyond it batches are dropped and resynced")
	dur(&c.KVEventsLinger, "kv-events-linger", d.KVEventsLinger,
		"how long kv_events changes gather before they are published (negative: each at once; at most 1s)")
	dur(&c.LoadWait, "load-wait", d.LoadWait,
		"how long a load waits for a key another copy is filling before it fails as a miss (cut to lease/2; keep it below the engines' request timeout)")
	// isolation
	num(&c.MaxEngines, "max-engines", d.MaxEngines, "most engines registered on this node")
	num(&c.MaxRequests, "max-requests", d.MaxRequests, "most live requests per engine")
	size(&c.MaxRequestStateBytes, "max-request-state-bytes", d.MaxRequestStateBytes,
		"most bytes of hashes and block ids one engine's live requests hold together (past it an event that would grow them is refused)")
	num(&c.MaxMappedSegments, "max-mapped-segments", d.MaxMappedSegments, "most engine segments mapped on this node")
	size(&c.MaxMappedBytes, "max-mapped-bytes", d.MaxMappedBytes,
		"most bytes of engine segments mapped on this node (each segment's span that its regions use, page-rounded)")
	num(&c.MaxModelLen, "max-model-len", d.MaxModelLen,
		"most tokens one request may hold: a spec's larger max_model_len is refused, an absent one bounded by it")
	str(&c.NATSConfig, "nats-config", d.NATSConfig, "nats-server config file for the embedded server (auth, TLS, accounts; see kvactors nats-config)")
	str(&c.NATSNKey, "nats-nkey", d.NATSNKey, "nkey seed file kvactors authenticates to NATS with")
	// pool
	size(&c.PoolPageBytes, "pool-page-bytes", d.PoolPageBytes,
		"pool page size: pages go to chunk sizes as needed; a chunk may span pages")
	num(&c.PoolMaxChunks, "pool-max-chunks", d.PoolMaxChunks,
		"most chunks the pool holds, whatever their size (each costs ~170 bytes of heap); past it stores evict as past --pool-bytes (0: one per 4KiB of --pool-bytes, at least 65536; at most 2^30)")
	str(&c.DiskDir, "disk-dir", d.DiskDir, "disk tier directory: chunks evicted from host memory go there; empty: no disk tier")
	size(&c.DiskBytes, "disk-bytes", d.DiskBytes, "disk tier budget (required with --disk-dir): chunk data; the files need about 1.5× it plus a segment (docs/OPERATIONS.md)")
	num(&c.DiskMaxChunks, "disk-max-chunks", d.DiskMaxChunks,
		"most chunks the disk tier holds, whatever their size (each costs ~190 bytes of heap); past it the least recently used go, as past --disk-bytes (0: one per 4KiB of --disk-bytes, at least 65536)")
	str(&c.LogLevel, "log-level", d.LogLevel, "log level: debug, info, warn, error")
	str(&c.LogFormat, "log-format", d.LogFormat, "log format: text or json")
	// cluster
	boolean(&c.Cluster, "cluster", d.Cluster, "join a cluster: claim engines in the ownership bucket (needs JetStream), serve and fetch chunks across nodes")
	str(&c.StandbyFor, "standby-for", d.StandbyFor, "stand by for this node: take its engines over when its ownership lease lapses (implies --cluster)")
	str(&c.ClusterBucket, "cluster-bucket", d.ClusterBucket, "ownership KV bucket (JetStream's rule: letters, digits, '-' and '_'; exit 2 otherwise)")
	num(&c.ClusterReplicas, "cluster-replicas", d.ClusterReplicas, "ownership bucket replicas (3 on a NATS cluster of 3 servers or more)")
	num(&c.FetchWindow, "fetch-window", d.FetchWindow, "fetch pieces in flight per remote chunk")
	dur(&c.FetchTimeout, "fetch-timeout", d.FetchTimeout, "bound on each fetch piece's round trip")
	dur(&c.ClusterClockSkew, "cluster-clock-skew", d.ClusterClockSkew,
		"how far the NATS servers' clocks may differ, or be stepped or slewed, within a lease: an owner stops serving an engine this long before the servers can expire its claim (0: --lease/10; at most --lease/2)")
	num(&c.ClusterMaxPeerKeys, "cluster-max-peer-keys", d.ClusterMaxPeerKeys,
		"most keys of each other node the holders index keeps; the keys past it are not indexed, counted and logged")
	c.NATSSecretsFromEnv()
	return f
}

// Parse parses args, then fills every setting not given as a flag from its
// KVACTORS_* variable, else from the --config file. The error wraps
// flag.ErrHelp (--help), ErrUsage (a bad flag or a stray argument) or
// ErrConfig (a bad variable, file or value); a malformed variable whose
// flag is given is not read at all.
func (f *Flags) Parse(args []string) error {
	f.fs.SetOutput(io.Discard) // the caller prints one line, not the usage
	if err := f.fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", ErrUsage, err)
	}
	if f.fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected argument %q: serve takes flags only", ErrUsage, f.fs.Arg(0))
	}
	given := map[string]string{} // flag name → where its value came from
	f.fs.Visit(func(fl *flag.Flag) { given[fl.Name] = "--" + fl.Name })
	if _, ok := given[configFlag]; !ok {
		if v, ok := os.LookupEnv(EnvName(configFlag)); ok {
			f.configFile = v
		}
	}
	file, err := readConfigFile(f.configFile, f.List)
	if err != nil {
		return err
	}
	for _, fl := range f.List {
		if _, ok := given[fl.Name]; ok || fl.Name == configFlag {
			continue
		}
		src, v, ok := fl.Env, "", false
		if v, ok = os.LookupEnv(fl.Env); !ok {
			src = f.configFile + ": " + fl.Name
			v, ok = file[fl.Name]
		}
		if !ok {
			continue
		}
		if err := f.fs.Set(fl.Name, v); err != nil {
			return fmt.Errorf("%w: %s=%q: %v", ErrConfig, src, v, err)
		}
		given[fl.Name] = src
	}
	for _, fl := range f.List {
		// A zero for a setting whose default is not zero would silently mean
		// the default (withDefaults): say so instead. (A false bool is a
		// value, not a zero.)
		v := f.fs.Lookup(fl.Name).Value
		if b, ok := v.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
			continue
		}
		if src, ok := given[fl.Name]; ok && !isZero(fl.Default) && isZero(v.String()) {
			return fmt.Errorf("%w: %s is %q: 0 or empty would mean the default %s; give a value",
				ErrConfig, src, v.String(), fl.Default)
		}
	}
	if f.cfg.Pprof && !loopback(f.cfg.HTTPAddr) {
		f.Warnings = append(f.Warnings, fmt.Sprintf("--pprof serves profiles on %s, beyond loopback: "+
			"anyone who reaches it can read the process's internals", f.cfg.HTTPAddr))
	}
	for _, u := range unusedSettings {
		why := u.unused(f.cfg)
		if why == "" {
			continue
		}
		for _, name := range u.names {
			if src, ok := given[name]; ok {
				f.Warnings = append(f.Warnings, fmt.Sprintf("%s is ignored: %s", src, why))
			}
		}
	}
	return nil
}

// UnknownEnv lists, sorted, the KVACTORS_* variables of environ (as
// os.Environ gives it) that name no flag. Parse ignores them, while an
// unknown config-file key fails start: the caller warns, so that a
// misspelled variable does not pass unseen. (It is not an error: kvactors'
// tests and scripts read KVACTORS_* variables of their own.)
func (f *Flags) UnknownEnv(environ []string) []string {
	known := make(map[string]bool, len(f.List))
	for _, fl := range f.List {
		known[fl.Env] = true
	}
	var unknown []string
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "KVACTORS_") && !known[name] {
			unknown = append(unknown, name)
		}
	}
	slices.Sort(unknown)
	return unknown
}

// Usage writes the flags and their defaults.
func (f *Flags) Usage(w io.Writer) {
	f.fs.SetOutput(w)
	f.fs.PrintDefaults()
}

// loopback reports whether addr (host:port) listens on loopback only.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func isZero(s string) bool { return s == "" || s == "0" || s == "0s" }

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

// bytesValue is a flag.Value of a byte size (ParseBytes).
type bytesValue int64

func (b *bytesValue) String() string { return FormatBytes(int64(*b)) }

func (b *bytesValue) Set(s string) error {
	n, err := ParseBytes(s)
	if err != nil {
		return err
	}
	*b = bytesValue(n)
	return nil
}

var byteUnits = []struct {
	s string
	m int64
}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}}

// FormatBytes is n in the largest binary unit that divides it (1GiB,
// 256MiB, 1000).
func FormatBytes(n int64) string {
	for _, u := range byteUnits {
		if n != 0 && n%u.m == 0 {
			return strconv.FormatInt(n/u.m, 10) + u.s
		}
	}
	return strconv.FormatInt(n, 10)
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
