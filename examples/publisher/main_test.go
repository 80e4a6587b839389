package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/natsauth"
	"github.com/kvactors/kvactors/node"
)

// TestPublisherAgainstANode runs the example against a real in-process
// node, then makes it fail after its segment exists (an engine id the SDK
// refuses) and with no NATS at all: each ends non-nil where it should and
// leaves no segment behind.
func TestPublisherAgainstANode(t *testing.T) {
	dir := t.TempDir()
	n, err := node.Start(context.Background(), node.Config{NATSPort: -1, NATSStoreDir: t.TempDir(), ShmDir: dir,
		PoolBytes: 1 << 20, HTTPAddr: "127.0.0.1:0", Registry: prometheus.NewRegistry(),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })

	out := captureStdout(t, func() {
		require.NoError(t, run(context.Background(), n.NATSURL(), "kvactors", dir, "example", defaultTimeout))
	})
	// Steps 1-5 of the README: the stored prefix is looked up and loaded
	// (run checks the loaded bytes).
	require.Contains(t, out, "<- lookup: 64 of 64 tokens stored")
	require.Contains(t, out, "<- loaded 64 tokens into blocks [5 6 7 8]")
	requireEmpty(t, dir)

	err = run(context.Background(), n.NATSURL(), "kvactors", dir, "_reserved", defaultTimeout)
	require.ErrorContains(t, err, "engine id")
	requireEmpty(t, dir)

	require.Error(t, run(context.Background(), "nats://127.0.0.1:1", "kvactors", dir, "example", defaultTimeout))
	requireEmpty(t, dir)
}

// captureStdout returns what f printed (the example reports on stdout).
func captureStdout(t *testing.T, f func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	old := os.Stdout
	os.Stdout = w
	got := make(chan []byte, 1)
	go func() { b, _ := io.ReadAll(r); got <- b }()
	defer func() { os.Stdout = old }()
	f()
	require.NoError(t, w.Close())
	return string(<-got)
}

func requireEmpty(t *testing.T, dir string) {
	t.Helper()
	left, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, left, "segments left in %s", dir)
}

// TestPublisherInterrupted: with NATS up but no node, the publisher keeps
// retrying its register; cancelling its context (what Ctrl-C does) ends it
// with an error and no segment left behind.
func TestPublisherInterrupted(t *testing.T) {
	s, _ := testkit.NATS(t)
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, s.ClientURL(), "kvactors", dir, "example", time.Minute) }()
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if left, _ := os.ReadDir(dir); len(left) == 0 {
			return errors.New("no segment yet")
		}
		return nil
	})
	cancel()
	require.ErrorIs(t, testkit.Recv(t, done, 5*time.Second, "the interrupted run"), context.Canceled)
	requireEmpty(t, dir)
}

// TestPublisherUnderGeneratedConfig: against the secured setup the docs
// recommend (a node on a configuration from `kvactors nats-config`, one
// nkey per engine) the publisher logs in with its engine's seed, given as
// --nkey or NATS_NKEY (natsOptions), and runs; with no credentials NATS
// refuses it.
func TestPublisherUnderGeneratedConfig(t *testing.T) {
	g, err := natsauth.Generate(natsauth.Options{Engines: []string{"example"}})
	require.NoError(t, err)
	secrets := t.TempDir()
	_, err = g.Write(secrets)
	require.NoError(t, err)
	dir := t.TempDir()
	n, err := node.Start(context.Background(), node.Config{NATSPort: -1, NATSStoreDir: t.TempDir(),
		NATSConfig: filepath.Join(secrets, natsauth.ConfigFile), NATSNKey: filepath.Join(secrets, natsauth.ServiceUser+".nk"),
		ShmDir: dir, PoolBytes: 1 << 20, HTTPAddr: node.HTTPOff, Registry: prometheus.NewRegistry(),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })

	err = run(context.Background(), n.NATSURL(), "kvactors", dir, "example", defaultTimeout)
	require.ErrorIs(t, err, nats.ErrAuthorization, "no credentials")
	requireEmpty(t, dir)

	seed := filepath.Join(secrets, "example.nk")
	for _, tc := range []struct{ flag, env string }{{seed, ""}, {"", seed}} {
		t.Setenv("NATS_NKEY", tc.env)
		opts, err := natsOptions(tc.flag, "", "")
		require.NoError(t, err)
		out := captureStdout(t, func() {
			require.NoError(t, run(context.Background(), n.NATSURL(), "kvactors", dir, "example", defaultTimeout, opts...))
		})
		require.Contains(t, out, "<- loaded 64 tokens into blocks [5 6 7 8]")
		requireEmpty(t, dir)
	}
	_, err = natsOptions(filepath.Join(secrets, "missing.nk"), "", "")
	require.Error(t, err, "a seed file that cannot be read")
}

// A --creds or --ca file that is missing, a directory, or not what it
// should be is refused by natsOptions, naming the flag (or its variable)
// and the path, before anything is set up: nats.go would read it only
// when it dials, and say less. Through main it exits 2, as a bad flag does,
// not 1 after a dial.
func TestBadSecretFilesAreRefusedAtStart(t *testing.T) {
	if missing := os.Getenv("PUBLISHER_TEST_CREDS"); missing != "" {
		os.Args = []string{"publisher", "--creds", missing, "--nats", "nats://127.0.0.1:1", "--shm-dir", t.TempDir()}
		main()
		return
	}
	g, err := natsauth.Generate(natsauth.Options{Engines: []string{"example"}})
	require.NoError(t, err)
	secrets := t.TempDir()
	_, err = g.Write(secrets)
	require.NoError(t, err)
	seed, missing := filepath.Join(secrets, "example.nk"), filepath.Join(secrets, "missing")
	t.Setenv("NATS_CREDS", "")
	for _, tc := range []struct {
		creds, ca, env, want string
	}{
		{creds: missing, want: "--creds " + missing + ": no such file or directory"},
		{creds: secrets, want: "--creds " + secrets + ": is a directory"},
		{creds: seed, want: "--creds " + seed + ": no user JWT in it: "},
		{ca: missing, want: "--ca " + missing + ": no such file or directory"},
		{ca: seed, want: "--ca " + seed + ": no PEM certificate in it"},
		{env: seed, want: "NATS_CA " + seed + ": no PEM certificate in it"},
	} {
		t.Setenv("NATS_CA", tc.env)
		_, err := natsOptions("", tc.creds, tc.ca)
		if strings.HasSuffix(tc.want, ": ") { // and nkeys' reason
			require.True(t, strings.HasPrefix(err.Error(), tc.want), "%v", err)
		} else {
			require.EqualError(t, err, tc.want)
		}
	}

	// A real credentials file passes (a user JWT signed by an account, and
	// the user's seed).
	account, err := nkeys.CreateAccount()
	require.NoError(t, err)
	user, err := nkeys.CreateUser()
	require.NoError(t, err)
	pub, err := user.PublicKey()
	require.NoError(t, err)
	token, err := jwt.NewUserClaims(pub).Encode(account)
	require.NoError(t, err)
	userSeed, err := user.Seed()
	require.NoError(t, err)
	file, err := jwt.FormatUserConfig(token, userSeed)
	require.NoError(t, err)
	good := filepath.Join(secrets, "example.creds")
	require.NoError(t, os.WriteFile(good, file, 0o600))
	t.Setenv("NATS_CA", "")
	opts, err := natsOptions("", good, "")
	require.NoError(t, err)
	require.Len(t, opts, 1)

	cmd := exec.Command(os.Args[0], "-test.run=^TestBadSecretFilesAreRefusedAtStart$")
	cmd.Env = append(os.Environ(), "PUBLISHER_TEST_CREDS="+missing)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "%s", out)
	require.Equal(t, 2, exit.ExitCode(), "%s", out)
	require.Contains(t, string(out), "publisher: --creds "+missing+": no such file or directory")
}
