package node_test

import (
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/node"
)

// parse binds a fresh Config to a fresh flag set and parses args.
func parse(t *testing.T, args ...string) (node.Config, *node.Flags, error) {
	t.Helper()
	var cfg node.Config
	f := cfg.BindFlags(flag.NewFlagSet("serve", flag.ContinueOnError))
	err := f.Parse(args)
	return cfg, f, err
}

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "kvactors.yaml")
	require.NoError(t, os.WriteFile(p, []byte(body), 0o600))
	return p
}

// With nothing given, the flags yield exactly DefaultConfig: the defaults
// are written once (issue 16), and the flags cannot disagree with the code.
func TestFlagDefaultsAreDefaultConfig(t *testing.T) {
	cfg, f, err := parse(t)
	require.NoError(t, err)
	d := node.DefaultConfig()
	// Secrets come from the environment, not the defaults.
	cfg.NATSUser, cfg.NATSPassword, cfg.NATSToken = "", "", ""
	require.Equal(t, d, cfg)
	require.Empty(t, f.Warnings)
	// And the zero Config means the same, setting by setting: Validate
	// accepts both, and withDefaults (via Start) fills the zero one to d.
	require.NoError(t, node.Config{}.Validate())
	require.NoError(t, d.Validate())
}

// Precedence: flag beats KVACTORS_* beats the --config file beats the
// default, setting by setting.
func TestFlagEnvFilePrecedence(t *testing.T) {
	file := writeFile(t, "pool-bytes: 3GiB\nprefix: fromfile\ndecode-workers: 7\nshutdown-timeout: 3s\npprof: true\n")
	t.Setenv("KVACTORS_PREFIX", "fromenv")
	t.Setenv("KVACTORS_DECODE_WORKERS", "5")
	cfg, _, err := parse(t, "--config", file, "--decode-workers", "9")
	require.NoError(t, err)
	require.Equal(t, int64(3<<30), cfg.PoolBytes, "file beats default")
	require.Equal(t, "fromenv", cfg.Prefix, "env beats file")
	require.Equal(t, 9, cfg.DecodeWorkers, "flag beats env and file")
	require.Equal(t, 3*time.Second, cfg.ShutdownTimeout)
	require.True(t, cfg.Pprof)
	require.Equal(t, node.DefaultConfig().HTTPAddr, cfg.HTTPAddr, "default where nothing is given")

	// KVACTORS_CONFIG names the file when --config does not.
	t.Setenv("KVACTORS_CONFIG", file)
	cfg, _, err = parse(t)
	require.NoError(t, err)
	require.Equal(t, int64(3<<30), cfg.PoolBytes)
}

// --disk-bytes without --disk-dir sizes no disk tier: a warning says so.
func TestDiskBytesWithoutDiskDirWarns(t *testing.T) {
	_, f, err := parse(t, "--disk-bytes", "10G")
	require.NoError(t, err)
	require.Len(t, f.Warnings, 1)
	require.Contains(t, f.Warnings[0], "--disk-bytes is ignored")
	_, f, err = parse(t, "--disk-bytes", "10G", "--disk-dir", t.TempDir())
	require.NoError(t, err)
	require.Empty(t, f.Warnings)
	_, f, err = parse(t, "--disk-max-chunks", "1000")
	require.NoError(t, err)
	require.Len(t, f.Warnings, 1)
	require.Contains(t, f.Warnings[0], "--disk-max-chunks is ignored")
}

// --nats-ca, --nats-cert and --nats-key without --nats are for no
// connection (the embedded server's is in-process, plain): a warning says
// so; with --nats, none.
func TestNATSTLSWithoutNATSWarns(t *testing.T) {
	_, f, err := parse(t, "--nats-ca", "ca.pem", "--nats-cert", "c.pem", "--nats-key", "k.pem")
	require.NoError(t, err)
	require.Len(t, f.Warnings, 3)
	for i, name := range []string{"--nats-ca", "--nats-cert", "--nats-key"} {
		require.Contains(t, f.Warnings[i], name+" is ignored: the node's connection to its embedded server is in-process, without TLS")
	}
	_, f, err = parse(t, "--nats-ca", "ca.pem", "--nats", "tls://127.0.0.1:4222")
	require.NoError(t, err)
	require.Empty(t, f.Warnings)
}

// A node id from a name with dots (a Kubernetes node name) is refused as
// given, and with --node-id-reduce kept to the characters an id may hold,
// as the host name is for the default id.
func TestNodeIDReduce(t *testing.T) {
	const name = "ip-10-0-1-23.us-west-2.compute.internal"
	cfg, _, err := parse(t, "--node-id", name)
	require.NoError(t, err)
	require.ErrorIs(t, cfg.Validate(), node.ErrConfig)
	cfg, _, err = parse(t, "--node-id", name, "--node-id-reduce")
	require.NoError(t, err)
	require.NoError(t, cfg.Validate())
	require.Equal(t, "ip-10-0-1-23us-west-2computeinternal", node.ReduceNodeID(name))
	require.Equal(t, "kvactors", node.ReduceNodeID("..."))
	require.Equal(t, "a_b", node.ReduceNodeID("_a_b"))
}

// --copy-workers starts that many goroutines at once (the transfer
// actor's workers): a huge count is refused (at most 256), not a node that
// runs out of memory starting them.
func TestCopyWorkersAreBounded(t *testing.T) {
	for _, n := range []string{"257", "1000000000"} {
		cfg, _, err := parse(t, "--copy-workers", n)
		require.NoError(t, err, n)
		require.ErrorIs(t, cfg.Validate(), node.ErrConfig, n)
		require.ErrorContains(t, cfg.Validate(), "--copy-workers "+n+": want 1..256", n)
	}
	for _, n := range []string{"1", "256"} {
		cfg, _, err := parse(t, "--copy-workers", n)
		require.NoError(t, err, n)
		require.NoError(t, cfg.Validate(), n)
	}
}

// A prefix whose subjects would fall under a namespace NATS reserves
// (_INBOX: an engine's verbs would pass for reply inboxes; $KV, $JS, $SYS)
// is refused, as are empty tokens and wildcards; the node and
// `kvactors nats-config` (natsauth) apply the one rule.
func TestReservedOrMalformedPrefixesAreRefused(t *testing.T) {
	for _, p := range []string{"_INBOX", "_INBOX.kv", "$KV.kv", "$SYS", "kv..x", "kv.", ".kv", "kv.*", "k v",
		strings.Repeat("k", 257)} { // past 256 bytes, subjects and replies may not fit the embedded server's control line
		cfg, _, err := parse(t, "--prefix", p)
		require.NoError(t, err, p)
		require.ErrorIs(t, cfg.Validate(), node.ErrConfig, p)
	}
	for _, p := range []string{"kvactors", "tenant_a.kv", "a-b.c_d", strings.Repeat("k", 256)} {
		cfg, _, err := parse(t, "--prefix", p)
		require.NoError(t, err, p)
		require.NoError(t, cfg.Validate(), p)
	}
}

// A pool that would need more pages than hostpool.MaxPages (its page
// numbers are int32, its page table ~64 B a page) is refused at start with
// the flag to raise; the same pool in larger pages starts.
func TestAPoolOfTooManyPagesIsRefused(t *testing.T) {
	cfg, _, err := parse(t, "--pool-bytes", "2T", "--pool-page-bytes", "64k")
	require.NoError(t, err)
	err = cfg.Validate()
	require.ErrorIs(t, err, node.ErrConfig)
	require.ErrorContains(t, err, "--pool-page-bytes")
	cfg, _, err = parse(t, "--pool-bytes", "2T", "--pool-page-bytes", "1M")
	require.NoError(t, err)
	require.NoError(t, cfg.Validate())
}

// A malformed variable is not read when its flag is given, and is an error
// naming it when it is not.
func TestMalformedEnvOnlyMattersWithoutTheFlag(t *testing.T) {
	t.Setenv("KVACTORS_POOL_BYTES", "lots")
	cfg, _, err := parse(t, "--pool-bytes", "2M")
	require.NoError(t, err)
	require.Equal(t, int64(2<<20), cfg.PoolBytes)
	_, _, err = parse(t)
	require.ErrorIs(t, err, node.ErrConfig)
	require.ErrorContains(t, err, "KVACTORS_POOL_BYTES")
}

// Every kind of bad input is an error of the right class, and changes
// nothing else: usage errors (the command line) vs config errors (values,
// variables, the file).
func TestBadSettingsAreClassified(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		file string
		want error
		say  string
	}{
		{"stray argument", []string{"extra", "--nats-port", "-1"}, "", node.ErrUsage, `unexpected argument "extra"`},
		{"unknown flag", []string{"--no-such"}, "", node.ErrUsage, "no-such"},
		{"malformed flag", []string{"--pool-bytes", "abc"}, "", node.ErrUsage, "bad byte size"},
		{"zero pool", []string{"--pool-bytes", "0"}, "", node.ErrConfig, "--pool-bytes"},
		{"zero workers", []string{"--copy-workers", "0"}, "", node.ErrConfig, "--copy-workers"},
		{"empty prefix", []string{"--prefix", ""}, "", node.ErrConfig, "--prefix"},
		{"unknown file key", nil, "pool-byts: 1G\n", node.ErrConfig, `unknown key "pool-byts"`},
		{"file key config", nil, "config: other.yaml\n", node.ErrConfig, `unknown key "config"`},
		{"malformed file value", nil, "pool-bytes: lots\n", node.ErrConfig, "pool-bytes"},
		{"zero in file", nil, "pool-bytes: 0\n", node.ErrConfig, "pool-bytes"},
		{"file key twice", nil, "pool-bytes: 1GiB\nhttp: \"off\"\npool-bytes: 2GiB\n", node.ErrConfig,
			`:3: key "pool-bytes" given twice (first at line 1)`},
		{"list in file", nil, "nats: [a, b]\n", node.ErrConfig, "single value"},
		{"not a mapping", nil, "- a\n", node.ErrConfig, "mapping"},
		{"not yaml", nil, "a: [\n", node.ErrConfig, "config file"},
		{"missing file", []string{"--config", "/nonexistent/kvactors.yaml"}, "", node.ErrConfig, "config file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := tc.args
			if tc.file != "" {
				args = append(args, "--config", writeFile(t, tc.file))
			}
			_, _, err := parse(t, args...)
			require.ErrorIs(t, err, tc.want)
			require.ErrorContains(t, err, tc.say)
		})
	}
	_, _, err := parse(t, "--help")
	require.True(t, errors.Is(err, flag.ErrHelp))
}

// --nats-port (and the other embedded-server settings) mean nothing with
// --nats: a warning names each, and where it came from.
func TestNATSPortWithExternalNATSWarns(t *testing.T) {
	t.Setenv("KVACTORS_NATS_HOST", "0.0.0.0")
	_, f, err := parse(t, "--nats", "nats://127.0.0.1:4222", "--nats-port", "5000")
	require.NoError(t, err)
	require.Len(t, f.Warnings, 2)
	require.Contains(t, f.Warnings[0], "KVACTORS_NATS_HOST")
	require.Contains(t, f.Warnings[1], "--nats-port")
	_, f, err = parse(t, "--nats-port", "5000") // the embedded server: no warning
	require.NoError(t, err)
	require.Empty(t, f.Warnings)
}

// The cluster's settings mean nothing on a node that is not clustered: a
// warning names each, and where it came from; with --cluster (or
// --standby-for) none.
func TestClusterSettingsWithoutClusterWarn(t *testing.T) {
	t.Setenv("KVACTORS_FETCH_WINDOW", "8")
	_, f, err := parse(t, "--cluster-max-peer-keys", "1000", "--cluster-replicas", "3")
	require.NoError(t, err)
	require.Len(t, f.Warnings, 3)
	require.Contains(t, f.Warnings[0], "--cluster-replicas")
	require.Contains(t, f.Warnings[1], "KVACTORS_FETCH_WINDOW")
	require.Contains(t, f.Warnings[2], "--cluster-max-peer-keys")
	for _, on := range [][]string{{"--cluster"}, {"--standby-for", "n9", "--node-id", "n1"}} {
		_, f, err = parse(t, append(on, "--cluster-max-peer-keys", "1000", "--cluster-replicas", "3")...)
		require.NoError(t, err)
		require.Empty(t, f.Warnings, "%v", on)
	}
}

// The flag table lists every Config field a flag sets, with the defaults
// of DefaultConfig in their flag syntax.
// --pprof beyond loopback works, with a warning.
func TestPprofBeyondLoopbackWarns(t *testing.T) {
	for addr, warn := range map[string]bool{"127.0.0.1:9464": false, "localhost:0": false, "[::1]:9464": false,
		"0.0.0.0:9464": true, ":9464": true, "10.0.0.5:9464": true} {
		_, f, err := parse(t, "--pprof", "--http", addr)
		require.NoError(t, err)
		require.Equal(t, warn, len(f.Warnings) == 1, "%s: %v", addr, f.Warnings)
	}
	_, f, err := parse(t, "--http", "0.0.0.0:9464")
	require.NoError(t, err)
	require.Empty(t, f.Warnings, "no pprof, nothing to warn about")
}

func TestFlagTableDefaults(t *testing.T) {
	_, f, err := parse(t)
	require.NoError(t, err)
	byName := map[string]node.Flag{}
	for _, fl := range f.List {
		byName[fl.Name] = fl
		require.Equal(t, node.EnvName(fl.Name), fl.Env)
	}
	d := node.DefaultConfig()
	require.Equal(t, "1GiB", byName["pool-bytes"].Default)
	require.Equal(t, node.FormatBytes(d.Transfer.MaxInFlightBytes), byName["max-inflight-bytes"].Default)
	require.Equal(t, d.ShutdownTimeout.String(), byName["shutdown-timeout"].Default)
	require.Equal(t, d.HTTPAddr, byName["http"].Default)
	require.True(t, reflect.DeepEqual(node.Flag{Name: "pprof", Env: "KVACTORS_PPROF", Default: "false",
		Usage: byName["pprof"].Usage}, byName["pprof"]))
}

func TestFormatBytesRoundTrips(t *testing.T) {
	for _, n := range []int64{0, 1, 1000, 1024, 3 << 20, 1 << 30, 5 << 40, 1<<30 + 1} {
		got, err := node.ParseBytes(node.FormatBytes(n))
		require.NoError(t, err)
		require.Equal(t, n, got, node.FormatBytes(n))
	}
}

// The help and the errors never offer 0 as "the default" where the parser
// refuses a zero (every flag whose default is not zero): the reader would
// try it and get exit 2.
func TestNoRefusedZeroOffered(t *testing.T) {
	_, f, err := parse(t)
	require.NoError(t, err)
	for _, fl := range f.List {
		if fl.Default == "" || fl.Default == "0" || fl.Default == "0s" {
			continue
		}
		require.NotRegexp(t, `\b0(s)?: (the )?default`, fl.Usage, "--%s", fl.Name)
		_, _, err := parse(t, "--"+fl.Name+"=0")
		if err == nil {
			continue // a bool, or a zero that is a value
		}
		require.ErrorIs(t, err, node.ErrConfig, "--%s=0", fl.Name)
	}
	cfg, _, err := parse(t, "--load-wait", "-1s")
	require.NoError(t, err)
	err = cfg.Validate()
	require.ErrorIs(t, err, node.ErrConfig)
	require.NotContains(t, err.Error(), "0: the default")
}

// A KVACTORS_* variable that names no flag is reported (serve warns: a
// misspelling would otherwise pass unseen); those that name one, the
// config file's included, and other variables are not.
func TestUnknownEnv(t *testing.T) {
	_, f, err := parse(t)
	require.NoError(t, err)
	require.Equal(t, []string{"KVACTORS_POOL_BYTE", "KVACTORS_ZZZ"}, f.UnknownEnv([]string{
		"KVACTORS_ZZZ=1", "KVACTORS_POOL_BYTES=1G", "KVACTORS_POOL_BYTE=1G", "KVACTORS_CONFIG=/x.yaml",
		"PATH=/bin", "NATS_TOKEN=t", "KVACTORS_NATS=nats://h:4222",
	}))
}

// Start refuses a NATS secret file it cannot read as a config error, before
// any connect attempt (Validate itself reads no file: a config can be
// checked away from its host).
func TestStartChecksNATSFiles(t *testing.T) {
	cfg := node.Config{NATSURL: "nats://127.0.0.1:1", NATSConnectTimeout: time.Minute, NATSCA: "/nonexistent/ca.pem"}
	require.NoError(t, cfg.Validate())
	start := time.Now()
	_, err := node.Start(t.Context(), cfg)
	require.ErrorIs(t, err, node.ErrConfig)
	require.ErrorContains(t, err, "--nats-ca")
	require.Less(t, time.Since(start), 10*time.Second, "no connect retries")
}

// Without --nats, --nats-ca, --nats-cert and --nats-key are ignored (the
// node's connection to its embedded server is in-process, plain; Parse warns
// so): a missing file fails neither CheckFiles nor the start. With --nats,
// the same files are a config error.
func TestIgnoredNATSTLSFilesNotChecked(t *testing.T) {
	tlsFiles := func(c *node.Config) {
		c.NATSCA, c.NATSCert, c.NATSKey = "/nonexistent/ca.pem", "/nonexistent/c.pem", "/nonexistent/k.pem"
	}
	var cfg node.Config
	tlsFiles(&cfg)
	require.NoError(t, cfg.CheckFiles())
	cfg.NATSCert = ""
	require.NoError(t, cfg.CheckFiles(), "a --nats-key without --nats-cert is ignored too")
	startNode(t, tlsFiles, func(c *node.Config) { // not retried as "nats not reachable" either
		c.NATSConnectTimeout = 5 * time.Second
	})

	for _, c := range []struct {
		mutate func(*node.Config)
		want   string
	}{
		{func(c *node.Config) { c.NATSCert, c.NATSKey = "", "" }, "--nats-ca"},
		{func(c *node.Config) { c.NATSCA = "" }, "--nats-cert /nonexistent/c.pem"},
		{func(c *node.Config) { c.NATSCA, c.NATSCert = "", "" }, "--nats-cert and --nats-key go together"},
	} {
		cfg := node.Config{NATSURL: "nats://127.0.0.1:1"}
		tlsFiles(&cfg)
		c.mutate(&cfg)
		err := cfg.CheckFiles()
		require.ErrorIs(t, err, node.ErrConfig)
		require.ErrorContains(t, err, c.want)
	}
}

// Every setting Validate refuses is named by its flag as the user typed
// it, first, in one style: 'bad config: --pool-bytes 100: want …' (a
// cluster setting's behind 'cluster: bad config: '). An exit-2 error that
// named a field ('max pending bytes …') left the operator to guess which
// of 60 flags it meant. Settings a flag cannot give (a negative size: the
// flag refuses it) are set on the parsed Config.
func TestEveryConfigRefusalNamesItsFlag(t *testing.T) {
	cases := []struct {
		flag   string
		args   []string
		mutate func(*node.Config)
	}{
		{"backend", []string{"--backend", "tape"}, nil},
		{"pool-bytes", nil, func(c *node.Config) { c.PoolBytes = -1 }},
		{"pool-page-bytes", nil, func(c *node.Config) { c.PoolPageBytes = -1 }},
		{"pool-bytes", []string{"--pool-bytes", "2T", "--pool-page-bytes", "64k"}, nil},
		{"pool-max-chunks", []string{"--pool-max-chunks", "-1"}, nil},
		{"pool-max-chunks", []string{"--pool-max-chunks", "1073741825"}, nil},
		{"disk-max-chunks", []string{"--disk-max-chunks", "-1"}, nil},
		{"disk-bytes", []string{"--disk-dir", "/var/lib/kvactors"}, nil},
		{"disk-bytes", nil, func(c *node.Config) { c.DiskBytes = -1 }},
		{"copy-workers", []string{"--copy-workers", "-1"}, nil},
		{"copy-workers", []string{"--copy-workers", "257"}, nil},
		{"max-inflight-bytes", nil, func(c *node.Config) { c.Transfer.MaxInFlightBytes = -1 }},
		{"decode-workers", []string{"--decode-workers", "-1"}, nil},
		{"decode-workers", []string{"--decode-workers", "257"}, nil},
		{"prefix", []string{"--prefix", strings.Repeat("k", 257)}, nil},
		{"prefix", []string{"--prefix", "kv.*"}, nil},
		{"nats-port", []string{"--nats-port", "65536"}, nil},
		{"nats-connect-timeout", []string{"--nats-connect-timeout", "-1s"}, nil},
		{"shutdown-timeout", []string{"--shutdown-timeout", "-1s"}, nil},
		{"node-id", []string{"--node-id", "_x"}, nil},
		{"lease", []string{"--lease", "30ms"}, nil},
		{"max-pending-bytes", []string{"--max-pending-bytes", "4095"}, nil},
		{"load-wait", []string{"--load-wait", "-1s"}, nil},
		{"kv-events-linger", []string{"--kv-events-linger", "2s"}, nil},
		{"max-engines", []string{"--max-engines", "-1"}, nil},
		{"max-requests", []string{"--max-requests", "-1"}, nil},
		{"max-mapped-segments", []string{"--max-mapped-segments", "-1"}, nil},
		{"max-mapped-bytes", nil, func(c *node.Config) { c.MaxMappedBytes = -1 }},
		{"max-model-len", []string{"--max-model-len", "-1"}, nil},
		{"nats-config", []string{"--nats-config", "/etc/nats.conf", "--nats", "nats://127.0.0.1:4222"}, nil},
		{"standby-for", []string{"--node-id", "a", "--standby-for", "a"}, nil},
		{"standby-for", []string{"--standby-for", "_x"}, nil},
		{"lease", []string{"--cluster", "--lease", "500ms"}, nil},
		{"http", []string{"--http", "foo"}, nil},
		{"nats", []string{"--nats", "nats://127.0.0.1:99999"}, nil},
		{"cluster-bucket", []string{"--cluster", "--cluster-bucket", "a.b"}, nil},
		{"cluster-replicas", []string{"--cluster", "--cluster-replicas", "6"}, nil},
		{"cluster-clock-skew", []string{"--cluster", "--cluster-clock-skew", "6s"}, nil},
		{"fetch-window", []string{"--cluster", "--fetch-window", "-1"}, nil},
		{"fetch-timeout", []string{"--cluster", "--fetch-timeout", "-1s"}, nil},
		{"cluster-max-peer-keys", []string{"--cluster", "--cluster-max-peer-keys", "-1"}, nil},
		{"log-level", []string{"--log-level", "loud"}, nil},
		{"log-format", []string{"--log-format", "xml"}, nil},
		{"max-ids", []string{"--max-ids", "-1"}, nil},
		{"max-groups", []string{"--max-groups", "-1"}, nil},
	}
	_, f, err := parse(t)
	require.NoError(t, err)
	flags := map[string]bool{}
	for _, fl := range f.List {
		flags[fl.Name] = true
	}
	for _, c := range cases {
		name := strings.Join(c.args, " ")
		if c.mutate != nil {
			name += " (--" + c.flag + " set on the Config)"
		}
		require.True(t, flags[c.flag], "%s: no flag --%s", name, c.flag)
		cfg, _, err := parse(t, c.args...)
		require.NoError(t, err, name)
		if c.mutate != nil {
			c.mutate(&cfg)
		}
		err = cfg.Validate()
		require.ErrorIs(t, err, node.ErrConfig, name)
		_, said, ok := strings.Cut(err.Error(), "bad config: ")
		require.True(t, ok, "%s: %v", name, err)
		if !strings.HasPrefix(said, "--"+c.flag+" ") {
			t.Errorf("%s: %q does not start with --%s and its value", name, said, c.flag)
		}
	}
}

// --pool-max-chunks is bound as every setting is: a flag, a KVACTORS_*
// variable or a config key, 0 its default (resolved from --pool-bytes when
// the node starts).
func TestPoolMaxChunksFromFlagOrEnv(t *testing.T) {
	cfg, _, err := parse(t, "--pool-max-chunks", "1000")
	require.NoError(t, err)
	require.Equal(t, 1000, cfg.PoolMaxChunks)
	require.NoError(t, cfg.Validate())
	t.Setenv("KVACTORS_POOL_MAX_CHUNKS", "2000")
	cfg, _, err = parse(t)
	require.NoError(t, err)
	require.Equal(t, 2000, cfg.PoolMaxChunks)
	cfg, _, err = parse(t, "--disk-max-chunks", "3000")
	require.NoError(t, err)
	require.Equal(t, 3000, cfg.DiskMaxChunks)
	t.Setenv("KVACTORS_DISK_MAX_CHUNKS", "4000")
	cfg, _, err = parse(t)
	require.NoError(t, err)
	require.Equal(t, 4000, cfg.DiskMaxChunks)
}
