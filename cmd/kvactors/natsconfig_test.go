package main

import (
	"encoding/json"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// The recipe of docs/SECURITY.md through the binary: nats-config writes a
// configuration and secrets; serve loads it (--nats-config, --nats-nkey);
// engine e1 registers with its own seed and inbox; e2 cannot publish on
// e1's subjects; an anonymous client is not let in.
func TestNATSConfigAndServeWithIt(t *testing.T) {
	out := filepath.Join(t.TempDir(), "nats")
	conf, err := exec.Command(binary, "nats-config", "--engines", "e1,e2", "--out", out).Output()
	require.NoError(t, err)
	require.Contains(t, string(conf), "authorization {")
	for _, f := range []string{"nats-server.conf", "_kvactors.nk", "e1.nk", "e2.nk"} {
		require.FileExists(t, filepath.Join(out, f))
	}
	bad, err := exec.Command(binary, "nats-config", "--engines", "_x", "--out", t.TempDir()).CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(bad), "not starting with '_'")

	dir := t.TempDir()
	cmd := exec.Command(binary, "serve", "--nats-port", "-1", "--http", "off", "--shm-dir", dir, "--pool-bytes", "1M",
		"--log-level", "warn", "--nats-config", filepath.Join(out, "nats-server.conf"),
		"--nats-nkey", filepath.Join(out, "_kvactors.nk"))
	serving, _ := startServe(t, cmd)
	url := servingURL(t, serving)

	_, err = nats.Connect(url)
	require.ErrorIs(t, err, nats.ErrAuthorization, "no anonymous clients")
	connect := func(id string, errs chan error) *nats.Conn {
		seed, err := nats.NkeyOptionFromSeed(filepath.Join(out, id+".nk"))
		require.NoError(t, err)
		// The SDK's connection: its inbox prefix is the one the permissions allow.
		nc, err := client.Dial(url, id, seed,
			nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { errs <- err }))
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		return nc
	}
	e1 := connect("e1", make(chan error, 8))
	seg, err := shm.Create(dir, "e1.kv", 64*256)
	require.NoError(t, err)
	defer seg.Close()
	spec, _ := json.Marshal(messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 64,
		Segments: []messages.Segment{seg.Spec()}, Groups: []messages.GroupSpec{{Kind: "full", TokensPerBlock: 4,
			Regions: []messages.Region{{BlockStride: 256, BlockBytes: 256}}}}})
	reply, err := e1.Request("kvactors.e1.register", spec, 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), `"ok":true`)

	e2errs := make(chan error, 8)
	e2 := connect("e2", e2errs)
	require.NoError(t, e2.Publish("kvactors.e1.events", []byte(`{}`)))
	require.NoError(t, e2.Flush())
	select {
	case err := <-e2errs:
		require.ErrorIs(t, err, nats.ErrPermissionViolation)
		require.Contains(t, err.Error(), "kvactors.e1.events")
	case <-time.After(5 * time.Second):
		t.Fatal("no permissions violation for e2 publishing on e1's subject")
	}
}

// The operator's view under a generated configuration: serve --cluster on
// the embedded server loaded from `nats-config --jetstream`, and `kvactors
// nodes` logged in as kvactors' user (its seed and inbox prefix) lists it.
// An engine's seed cannot survey the cluster: its permissions refuse it.
func TestNodesUnderGeneratedConfig(t *testing.T) {
	out := filepath.Join(t.TempDir(), "nats")
	_, err := exec.Command(binary, "nats-config", "--engines", "e1", "--jetstream", "--out", out).Output()
	require.NoError(t, err)
	dir := t.TempDir()
	cmd := exec.Command(binary, "serve", "--nats-port", "-1", "--http", "off", "--shm-dir", dir, "--pool-bytes", "1M",
		"--log-level", "warn", "--nats-config", filepath.Join(out, "nats-server.conf"),
		"--nats-nkey", filepath.Join(out, "_kvactors.nk"), "--cluster", "--node-id", "gpu-7", "--lease", "2s")
	serving, _ := startServe(t, cmd)
	url := servingURL(t, serving)

	nodes := exec.Command(binary, "nodes", "--nats", url, "--nats-nkey", filepath.Join(out, "_kvactors.nk"), "--wait", "1500ms")
	listing, err := nodes.CombinedOutput()
	require.NoError(t, err, string(listing))
	require.Regexp(t, regexp.MustCompile(`(?m)^gpu-7\s+[0-9a-f]{16}\s+0\s+-\s+`), string(listing))

	denied, err := exec.Command(binary, "nodes", "--nats", url, "--nats-nkey", filepath.Join(out, "e1.nk"), "--wait", "500ms").CombinedOutput()
	require.Error(t, err, "an engine's seed may not survey the cluster:\n%s", denied)
	require.Contains(t, string(denied), "permissions violation", "refused by the server's permissions, not another failure")
	require.NotContains(t, string(denied), "gpu-7")
	t.Logf("engine seed: %s", denied)
}

// nats-config's hint on stderr is the serve command the configuration is
// for: with --jetstream that is a clustered node (the JetStream is for
// serve --cluster), on the embedded server loaded from the file or on an
// external NATS run from it; without, a node on the embedded server.
func TestNATSConfigHintFitsJetStream(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		want    []string
		notWant []string
	}{
		{nil, []string{"kvactors serve --nats-config ", "--nats-nkey "}, []string{"--cluster", "--nats URL"}},
		{[]string{"--jetstream"}, []string{"kvactors serve --nats-config ", "--nats-nkey ", "--cluster",
			"nats-server -c ", "kvactors serve --nats URL"}, nil},
		{[]string{"--jetstream", "--auth", "password"}, []string{"NATS_USER=_kvactors", "--nats-config ", "--cluster",
			"kvactors serve --nats URL"}, []string{"--nats-nkey"}},
	} {
		out := filepath.Join(t.TempDir(), "nats")
		var stdout, stderr strings.Builder
		code := natsConfig(append([]string{"--engines", "e1", "--out", out}, tc.args...), &stdout, &stderr)
		require.Equal(t, exitOK, code, stderr.String())
		hint := stderr.String()
		for _, w := range tc.want {
			require.Contains(t, hint, w, "%v", tc.args)
		}
		for _, w := range tc.notWant {
			require.NotContains(t, hint, w, "%v", tc.args)
		}
	}
}

// nats-config's hint is complete for every combination of its options:
// each serve line logs kvactors in (its seed, or its password from the
// environment) and names a --prefix other than the default (the
// permissions are for it); the line for NATS servers over TCP (--nats URL)
// with TLS adds --nats-ca, and --nats-cert/--nats-key when the server
// verifies clients' certificates, their placeholders explained on a line
// of their own, while the embedded server's line needs neither (its node's
// connection is in-process, plain). The hint for the strictest (TLS with
// client certificates, another prefix) is run as given: the node it starts
// is let in.
func TestNATSConfigHintIsComplete(t *testing.T) {
	certs := testkit.TLS(t)
	tlsArgs := map[string][]string{"": nil, "tls": {"--tls-cert", certs.Cert, "--tls-key", certs.Key},
		"verify": {"--tls-cert", certs.Cert, "--tls-key", certs.Key, "--tls-ca", certs.CA}}
	for _, auth := range []string{"nkey", "password"} {
		for _, js := range []bool{false, true} {
			for _, tlsMode := range []string{"", "tls", "verify"} {
				for _, prefix := range []string{"", "p1"} {
					out := filepath.Join(t.TempDir(), "nats")
					args := append([]string{"--engines", "e1", "--out", out, "--auth", auth}, tlsArgs[tlsMode]...)
					if js {
						args = append(args, "--jetstream")
					}
					if prefix != "" {
						args = append(args, "--prefix", prefix)
					}
					var stdout, stderr strings.Builder
					require.Equal(t, exitOK, natsConfig(args, &stdout, &stderr), stderr.String())
					var serves []string
					for _, l := range strings.Split(stderr.String(), "\n") {
						if i := strings.Index(l, "kvactors serve "); i >= 0 {
							serves = append(serves, l[i:])
						}
					}
					require.Len(t, serves, map[bool]int{false: 1, true: 2}[js], "%v:\n%s", args, stderr.String())
					for _, line := range serves {
						check := func(has bool, flag string) {
							if has {
								require.Contains(t, line, flag, "%v", args)
							} else {
								require.NotContains(t, line, flag, "%v", args)
							}
						}
						check(auth == "nkey", " --nats-nkey "+out+"/_kvactors.nk")
						check(prefix != "", " --prefix p1")
						tcp := strings.Contains(line, " --nats URL")
						check(tcp && tlsMode != "", " --nats-ca CA.pem")
						check(tcp && tlsMode == "verify", " --nats-cert CERT.pem --nats-key KEY.pem")
					}
					if auth == "password" {
						require.Contains(t, stderr.String(), "NATS_USER=_kvactors NATS_PASSWORD=", "%v", args)
					}
					require.Equal(t, js && tlsMode != "", strings.Contains(stderr.String(), "CA.pem: the CA that signed "+certs.Cert),
						"%v:\n%s", args, stderr.String())
					require.Equal(t, js && tlsMode == "verify", strings.Contains(stderr.String(),
						"CERT.pem, KEY.pem: kvactors' client certificate and its key, signed by a CA in "+certs.CA),
						"%v:\n%s", args, stderr.String())
					// A NATS cluster's hosts share its servers: max_connections
					// is each one's, sized for all that may connect to it.
					require.Equal(t, js, strings.Contains(stderr.String(), "max_connections 256 (--max-connections) "+
						"is per server: size it for the engines, nodes and routers that may connect to one"),
						"%v:\n%s", args, stderr.String())
				}
			}
		}
	}

	var stdout, stderr strings.Builder
	require.Equal(t, exitOK, natsConfig([]string{"--engines", "e1", "--out", filepath.Join(t.TempDir(), "nats"),
		"--jetstream", "--max-connections", "1000"}, &stdout, &stderr))
	require.Contains(t, stderr.String(), "max_connections 1000 (--max-connections) is per server")

	out := filepath.Join(t.TempDir(), "nats")
	stdout.Reset()
	stderr.Reset()
	require.Equal(t, exitOK, natsConfig(append([]string{"--engines", "e1", "--out", out, "--prefix", "p1"},
		tlsArgs["verify"]...), &stdout, &stderr))
	_, line, ok := strings.Cut(strings.Split(stderr.String(), "\n")[1], "serve with: kvactors ")
	require.True(t, ok, stderr.String())
	require.NotContains(t, line, ".pem", "no file to fill in for the embedded server's node")
	cmd := exec.Command(binary, append(strings.Fields(line), "--nats-port", "-1", "--http", "off",
		"--shm-dir", t.TempDir(), "--pool-bytes", "1M", "--log-level", "warn")...)
	serving, _ := startServe(t, cmd)
	require.Contains(t, serving, `prefix "p1"`)
}
