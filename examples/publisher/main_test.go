package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
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
