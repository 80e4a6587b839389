package sim_test

import (
	"context"
	"io"
	"log/slog"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/node"
	"github.com/kvactors/kvactors/sim"
)

// startNode runs a real node on an embedded NATS server on a random port,
// with the shm backend in a test directory, and connects a client to it.
func startNode(t *testing.T, poolBytes int64) (*nats.Conn, string, *node.Node) {
	nc, dir, n, _ := startNodeWithRegistry(t, poolBytes)
	return nc, dir, n
}

func startNodeWithRegistry(t *testing.T, poolBytes int64) (*nats.Conn, string, *node.Node, *prometheus.Registry) {
	t.Helper()
	dir := t.TempDir()
	reg := prometheus.NewRegistry()
	n, err := node.Start(context.Background(), node.Config{NATSPort: -1, ShmDir: dir, PoolBytes: poolBytes,
		HTTPAddr: node.HTTPOff, Log: quietLog(), Registry: reg})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	nc, err := nats.Connect(n.NATSURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc, dir, n, reg
}

// engineConn is a connection of engine's to nc's server, with the engine's
// own reply inbox (client.Options), the only one the node answers it on.
func engineConn(t *testing.T, nc *nats.Conn, engine string) *nats.Conn {
	t.Helper()
	enc, err := nats.Connect(nc.ConnectedUrl(), client.Options(engine)...)
	require.NoError(t, err)
	t.Cleanup(enc.Close)
	return enc
}

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// smallConfig is an engine that serves a few dozen short requests in a
// second or two, with few enough blocks that block pressure preempts.
func smallConfig(engine, shmDir string) sim.Config {
	c := sim.DefaultConfig()
	c.Engine = engine
	c.ShmDir = shmDir
	c.Requests = 40
	c.ArrivalsPerStep = 1
	c.StepInterval = time.Millisecond
	c.MinPromptTokens, c.MaxPromptTokens = 16, 384
	c.MinOutputTokens, c.MaxOutputTokens = 2, 40
	c.SharedPrefixTokens = 128
	c.NumGPUBlocks = 160
	c.VerifyBlocks = 32
	c.MaxRunning = 12
	c.PrefillChunk = 128
	c.PreemptRatio = 0.2
	c.QueuedAbortRatio, c.MidAbortRatio = 0.1, 0.1
	c.StallTimeout = 10 * time.Second
	c.Log = quietLog()
	return c
}

func runCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestRunPassesEveryCheck(t *testing.T) {
	nc, dir, _, reg := startNodeWithRegistry(t, 64<<20)
	cfg := smallConfig("e1", dir)
	done := 0
	cfg.OnRequestDone = func() { done++ } // one engine: called from one goroutine
	rep, err := sim.Run(runCtx(t), engineConn(t, nc, cfg.Engine), cfg)
	require.NoError(t, err)
	require.NoError(t, rep.Err(), "failures: %v", rep.Failures)
	t.Logf("report: %+v", rep)

	require.Equal(t, cfg.Requests, rep.Requests)
	require.Equal(t, cfg.Requests, done)
	require.Equal(t, cfg.Requests, rep.Finished+rep.AbortedQueued+rep.AbortedMidPrefill)
	require.Positive(t, rep.Finished)
	require.Positive(t, rep.AbortedQueued)
	require.Positive(t, rep.Preemptions)
	require.Positive(t, rep.ChunksStored)
	require.Positive(t, rep.ChunksReady)
	require.Equal(t, rep.ChunksReady, rep.ReadyStored+rep.Deduplicated+rep.ReadyEvicted+rep.ReadySkipped)
	require.Positive(t, rep.VerifyOK)
	require.Zero(t, rep.VerifyFailed)
	require.Zero(t, rep.Evictions, "the pool is large enough that nothing is evicted")
	require.Zero(t, rep.VerifyEvicted)
	require.Equal(t, rep.Finished, rep.Releases["finished"])
	require.Equal(t, rep.AbortedQueued+rep.AbortedMidPrefill, rep.Releases["aborted"])
	require.Equal(t, rep.Preemptions, rep.Releases["preempted"])
	require.Equal(t, rep.Steps >= rep.Batches, true)
	require.Positive(t, rep.Events)

	// The node's own counts agree with what the engine saw.
	stats, err := sim.GatherNodeStats(reg)
	require.NoError(t, err)
	require.Equal(t, float64(rep.ChunksStored), stats.ChunksStored)
	require.Equal(t, float64(rep.Preemptions), stats.Releases["preempted"])
	require.Equal(t, float64(rep.StoredJobs), stats.Decisions)
	require.Equal(t, float64(rep.BytesStored), stats.CopyBytes["GPU_to_CPU"])
	require.Empty(t, stats.Rejected)
	require.Positive(t, stats.DecisionP99)
	require.LessOrEqual(t, stats.DecisionP50, stats.DecisionP99)
	var out strings.Builder
	sim.WriteSummary(&out, []sim.Report{rep}, stats, rep.Serving)
	require.Contains(t, out.String(), "integrity")
	require.Contains(t, out.String(), "OK: ")
}

func TestQuantileInterpolatesInBuckets(t *testing.T) {
	bucket := func(upper float64, count uint64) *dto.Bucket {
		return &dto.Bucket{UpperBound: &upper, CumulativeCount: &count}
	}
	n := uint64(100)
	h := &dto.Histogram{SampleCount: &n, Bucket: []*dto.Bucket{
		bucket(1, 50), bucket(2, 90), bucket(4, 100), bucket(math.Inf(1), 100)}}
	require.InDelta(t, 1.0, sim.Quantile(0.5, h), 1e-9)
	require.InDelta(t, 0.5, sim.Quantile(0.25, h), 1e-9, "the first bucket interpolates from 0")
	require.InDelta(t, 1.5, sim.Quantile(0.7, h), 1e-9)
	require.InDelta(t, 3.8, sim.Quantile(0.99, h), 1e-9)
	zero := uint64(0)
	require.True(t, math.IsNaN(sim.Quantile(0.5, &dto.Histogram{SampleCount: &zero})))
}

func TestTwoEnginesDeduplicateSharedPrefixes(t *testing.T) {
	nc, dir, _ := startNode(t, 64<<20)
	ctx := runCtx(t)
	type result struct {
		rep sim.Report
		err error
	}
	results := make(chan result, 2)
	for _, id := range []string{"a", "b"} {
		cfg := smallConfig(id, dir)
		cfg.SharedRatio = 0.8
		enc := engineConn(t, nc, id)
		go func() {
			rep, err := sim.Run(ctx, enc, cfg)
			results <- result{rep, err}
		}()
	}
	var total sim.Report
	for range 2 {
		select {
		case r := <-results:
			require.NoError(t, r.err)
			require.NoError(t, r.rep.Err(), "failures: %v", r.rep.Failures)
			total.Add(r.rep)
		case <-ctx.Done():
			t.Fatal("timed out waiting for both engines")
		}
	}
	t.Logf("total: %+v", total)
	require.Positive(t, total.Deduplicated, "shared prefixes must deduplicate")
	require.Equal(t, total.ChunksReady, total.ReadyStored+total.Deduplicated+total.ReadyEvicted+total.ReadySkipped)
}

// TestEvictionIsNotAFailure runs with a pool far too small for everything
// stored: keys are evicted before the check loads them, and the check tells
// that apart from a loss.
func TestEvictionIsNotAFailure(t *testing.T) {
	nc, dir, _ := startNode(t, 2<<20) // 128 chunks of 16 KiB
	rep, err := sim.Run(runCtx(t), engineConn(t, nc, "e1"), smallConfig("e1", dir))
	require.NoError(t, err)
	require.NoError(t, rep.Err(), "failures: %v", rep.Failures)
	require.Positive(t, rep.Evictions)
	require.Positive(t, rep.VerifyEvicted)
	require.Positive(t, rep.VerifyOK)
}

func TestConfigValidate(t *testing.T) {
	base := sim.DefaultConfig()
	base.ShmDir = t.TempDir()
	require.NoError(t, base.Validate())
	for name, mut := range map[string]func(*sim.Config){
		"engine id":      func(c *sim.Config) { c.Engine = "a.b" },
		"chunk vs hash":  func(c *sim.Config) { c.TokensPerHash = 3 },
		"verify blocks":  func(c *sim.Config) { c.VerifyBlocks = 3 },
		"ratio":          func(c *sim.Config) { c.PreemptRatio = 1.5 },
		"too long":       func(c *sim.Config) { c.MaxPromptTokens = 1 << 20 },
		"window":         func(c *sim.Config) { c.Groups = []sim.Group{{Kind: "sliding_window", TokensPerBlock: 16}} },
		"kind":           func(c *sim.Config) { c.Groups = []sim.Group{{Kind: "mamba", TokensPerBlock: 16}} },
		"missing shm":    func(c *sim.Config) { c.ShmDir = "/nonexistent/kvactors" },
		"no requests":    func(c *sim.Config) { c.Requests = 0 },
		"prompt range":   func(c *sim.Config) { c.MinPromptTokens = 10; c.MaxPromptTokens = 5 },
		"abort ratio":    func(c *sim.Config) { c.QueuedAbortRatio, c.MidAbortRatio = 0.6, 0.6 },
		"step interval":  func(c *sim.Config) { c.StepInterval = 0 },
		"arrivals":       func(c *sim.Config) { c.ArrivalsPerStep = 0 },
		"regions":        func(c *sim.Config) { c.RegionsPerGroup = 0 },
		"num gpu blocks": func(c *sim.Config) { c.NumGPUBlocks = 10 },
	} {
		t.Run(name, func(t *testing.T) {
			c := base
			mut(&c)
			require.ErrorIs(t, c.Validate(), sim.ErrConfig)
		})
	}
}

// TestCorruptedPoolFailsTheCheck flips one byte every 16 KiB of the pool
// before the check: every stored chunk must then fail verification, and it
// fails at the store's checksum (PROTOCOL.md, "Integrity"): the load is
// refused naming the key, so the corrupt bytes never reach the engine.
func TestCorruptedPoolFailsTheCheck(t *testing.T) {
	const pool, slot = 8 << 20, 16 << 10 // the default layout's chunk is 2 blocks * 2 regions * 4 KiB
	nc, dir, n := startNode(t, pool)
	cfg := smallConfig("e1", dir)
	cfg.Requests = 10
	cfg.BeforeCheck = func() {
		mem := n.Arena().Bytes()
		for off := 100; off < len(mem); off += slot {
			mem[off] ^= 0xff
		}
	}
	rep, err := sim.Run(runCtx(t), engineConn(t, nc, cfg.Engine), cfg)
	require.NoError(t, err)
	require.ErrorIs(t, rep.Err(), sim.ErrCheck)
	require.Positive(t, rep.ChunksStored)
	require.Zero(t, rep.VerifyOK)
	require.Equal(t, len(rep.Failures) > 0, true)
	require.Positive(t, rep.VerifyFailed)
	require.Contains(t, rep.Failures[0], "chunk checksum mismatch")
	require.Regexp(t, `key [0-9a-f]+: store: chunk checksum mismatch`, rep.Failures[0])
}

func TestPatternIsDeterministic(t *testing.T) {
	h := sim.ChainHash(sim.ChainHash(sim.Hash{}, []uint32{1, 2, 3, 4}), []uint32{5, 6, 7, 8})
	require.Equal(t, h, sim.ChainHash(sim.ChainHash(sim.Hash{}, []uint32{1, 2, 3, 4}), []uint32{5, 6, 7, 8}))
	require.NotEqual(t, h, sim.ChainHash(sim.ChainHash(sim.Hash{}, []uint32{1, 2, 3, 5}), []uint32{5, 6, 7, 8}),
		"a hash names its whole prefix")

	fill := func(h sim.Hash, g, r, b int) []byte {
		buf := make([]byte, 4096)
		sim.FillBlock(buf, h, g, r, b)
		return buf
	}
	base := fill(h, 1, 0, 3)
	require.Equal(t, base, fill(h, 1, 0, 3), "same content, group, region and position: same bytes")
	require.NotEqual(t, make([]byte, 4096), base)
	for name, other := range map[string][]byte{
		"hash":     fill(sim.ChainHash(h, []uint32{9, 9, 9, 9}), 1, 0, 3),
		"group":    fill(h, 0, 0, 3),
		"region":   fill(h, 1, 1, 3),
		"position": fill(h, 1, 0, 4),
	} {
		require.NotEqual(t, base, other, "a different %s must give different bytes", name)
	}

	require.Equal(t, 2*(sim.HashBytes+4), len(sim.KeyHex(h, 7)))
	require.Equal(t, "00000007", sim.KeyHex(h, 7)[2*sim.HashBytes:], "the group is 4 big-endian bytes")
}
