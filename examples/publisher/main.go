// Command publisher is the smallest engine that speaks kvactors protocol v2,
// through the Go SDK (package client): it owns one shared-memory segment as
// its "GPU", registers, runs one request through prefill with its hashes
// lagging a step behind its tokens, finishes it, waits for `released`,
// looks the prompt up and loads what is stored into fresh blocks (checking
// the bytes), as a second request with that prompt would. Run `kvactors serve` first, then
//
//	go run ./examples/publisher --nats nats://127.0.0.1:4222
//
// (or set NATS_URL). Under a configuration from `kvactors nats-config`
// (docs/SECURITY.md), log in as the engine's user: --nkey FILE (its seed,
// <engine>.nk; or NATS_NKEY), or --creds FILE (NATS_CREDS), or
// NATS_USER/NATS_PASSWORD (--auth password); --ca FILE (NATS_CA) for TLS.
// A --nkey, --creds or --ca file that cannot be read or is not one exits 2
// at start, naming the flag and path. It exits non-zero on any error, a refused register
// included, and removes its segment on every exit path, Ctrl-C included.
package main

import (
	"context"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/natsauth"
)

const (
	blockBytes = 4096
	numBlocks  = 256
	tokens     = 16 // per block and per hash

	defaultTimeout = 10 * time.Second
)

func main() {
	defURL := os.Getenv("NATS_URL")
	if defURL == "" {
		defURL = nats.DefaultURL
	}
	url := flag.String("nats", defURL, "NATS URL of kvactors (default $NATS_URL, else "+nats.DefaultURL+")")
	prefix := flag.String("prefix", "kvactors", "kvactors' subject prefix (its --prefix)")
	shmDir := flag.String("shm-dir", "/dev/shm", "kvactors' --shm-dir")
	engine := flag.String("engine", "example", "engine id")
	timeout := flag.Duration("timeout", defaultTimeout, "give up registering or waiting for released after this")
	nkey := flag.String("nkey", "", "the engine's nkey seed file (default $NATS_NKEY)")
	creds := flag.String("creds", "", "NATS credentials file (default $NATS_CREDS)")
	ca := flag.String("ca", "", "CA certificate file for NATS TLS (default $NATS_CA)")
	flag.Parse()
	opts, err := natsOptions(*nkey, *creds, *ca)
	if err != nil {
		fmt.Fprintln(os.Stderr, "publisher:", err)
		os.Exit(2)
	}
	// Ctrl-C or SIGTERM end the run through ctx, so the deferred clean-up
	// (the segment, the session) runs on that exit path too.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *url, *prefix, *shmDir, *engine, *timeout, opts...); err != nil {
		stop()
		fmt.Fprintln(os.Stderr, "publisher:", err)
		os.Exit(1)
	}
}

// natsOptions logs the engine in: an nkey seed file, a credentials file
// (each its flag, else NATS_NKEY, NATS_CREDS), NATS_USER/NATS_PASSWORD or
// NATS_TOKEN (secrets from the environment only, as kvactors serve takes
// them), and a CA file (NATS_CA) for TLS. None: an anonymous login.
func natsOptions(nkey, creds, ca string) ([]nats.Option, error) {
	orEnv := func(v, k string) string {
		if v == "" {
			return os.Getenv(k)
		}
		return v
	}
	// Where each came from, for its errors.
	name := func(v, flag, env string) string {
		if v == "" {
			return env
		}
		return flag
	}
	credsName, caName := name(creds, "--creds", "NATS_CREDS"), name(ca, "--ca", "NATS_CA")
	nkey, creds, ca = orEnv(nkey, "NATS_NKEY"), orEnv(creds, "NATS_CREDS"), orEnv(ca, "NATS_CA")
	for _, f := range []struct {
		name, path string
		check      func(string) error
	}{{credsName, creds, checkCreds}, {caName, ca, checkCA}} {
		if f.path == "" {
			continue
		}
		if err := f.check(f.path); err != nil {
			return nil, fmt.Errorf("%s %s: %w", f.name, f.path, err)
		}
	}
	var opts []nats.Option
	if nkey != "" {
		opt, err := nats.NkeyOptionFromSeed(nkey)
		if err != nil {
			return nil, fmt.Errorf("--nkey: %w", err)
		}
		opts = append(opts, opt)
	}
	if creds != "" {
		opts = append(opts, nats.UserCredentials(creds))
	}
	if user := os.Getenv("NATS_USER"); user != "" {
		opts = append(opts, nats.UserInfo(user, os.Getenv("NATS_PASSWORD")))
	}
	if token := os.Getenv("NATS_TOKEN"); token != "" {
		opts = append(opts, nats.Token(token))
	}
	if ca != "" {
		opts = append(opts, nats.RootCAs(ca))
	}
	return opts, nil
}

// checkCreds reads a credentials file now: nats.go reads it only when it
// dials, after the set-up.
func checkCreds(path string) error { return checkWith(path, natsauth.CheckCreds) }

// checkCA reads a CA file now, as checkCreds does.
func checkCA(path string) error { return checkWith(path, natsauth.CheckCA) }

func checkWith(path string, check func([]byte) error) error {
	data, err := readFile(path)
	if err != nil {
		return err
	}
	return check(data)
}

// readFile is os.ReadFile with the path left out of its error (the
// caller's names it with its flag).
func readFile(path string) ([]byte, error) {
	data, err := os.ReadFile(path)
	if pe := (*fs.PathError)(nil); errors.As(err, &pe) {
		return nil, pe.Err
	}
	return data, err
}

// run is the example; opts log it in (natsOptions).
func run(ctx context.Context, url, prefix, shmDir, engine string, timeout time.Duration, opts ...nats.Option) (err error) {
	nc, err := client.Dial(url, engine, opts...)
	if err != nil {
		return err
	}
	defer nc.Close()

	// The engine's KV cache: one segment (named after the engine, as
	// kvactors requires), one group, one region (layer).
	seg, err := shm.Create(shmDir, engine+"-kv", numBlocks*blockBytes)
	if err != nil {
		return fmt.Errorf("create segment: %w", err)
	}
	defer func() { err = errors.Join(err, seg.Remove()) }()
	spec := messages.EngineSpec{TokensPerHash: tokens, BlocksPerChunk: 1, NumGPUBlocks: numBlocks,
		Segments: []messages.Segment{seg.Spec()},
		Groups: []messages.GroupSpec{{Kind: messages.KindFull, TokensPerBlock: tokens,
			Regions: []messages.Region{{Segment: 0, Offset: 0, BlockStride: blockBytes, BlockBytes: blockBytes}}}}}

	released := make(chan client.Release, 1)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	c, err := client.Connect(ctx, nc, client.Config{Engine: engine, Prefix: prefix, Spec: spec,
		OnReleased: func(r client.Release) { released <- r },
		OnStored: func(s messages.Stored) {
			fmt.Printf("<- stored job %d: %d chunks, %d bytes\n", s.Job, len(s.Chunks), s.Bytes)
		}})
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, c.Close()) }()
	st := c.Stats()
	fmt.Printf("<- registered with node %s (boot %s)\n", st.Node, st.Boot)

	// One request of 64 tokens: 4 blocks (ids 1..4), allocated up front.
	// Each step computes 16 tokens; its hash is announced one step later.
	hash := func(i int) []byte { h := make([]byte, 32); h[31] = byte(i); return h }
	// An event the node would reject (a bad id, a negative count) is
	// refused here, and its release would never come: check each.
	if err := errors.Join(c.Added("r1", 64), c.Blocks("r1", 0, 0, []uint32{1, 2, 3, 4})); err != nil {
		return err
	}
	if err := flush(c); err != nil {
		return err
	}
	for step := 1; step <= 4; step++ {
		// Write the KV of block `step` before announcing it as computed.
		b := seg.Bytes()[step*blockBytes : (step+1)*blockBytes]
		for i := range b {
			b[i] = byte(step)
		}
		if err := c.Tokens("r1", tokens*step, 64); err != nil {
			return err
		}
		if step > 1 { // async scheduling: the hash of the previous block arrives now
			if err := c.Hashes("r1", step-2, hash(step-1)); err != nil {
				return err
			}
		}
		if err := flush(c); err != nil {
			return err
		}
	}
	if err := errors.Join(c.Hashes("r1", 3, hash(4)), c.Finished("r1", false, 64, 64)); err != nil {
		return err
	}
	if err := flush(c); err != nil {
		return err
	}
	select { // the engine may reuse r1's blocks only after released
	case r := <-released:
		fmt.Printf("<- released %s (%s)\n", r.Request, r.Reason)
	case <-ctx.Done():
		return fmt.Errorf("no released: %w", ctx.Err())
	}
	var hs []string
	for i := 1; i <= 4; i++ {
		hs = append(hs, hex.EncodeToString(hash(i)))
	}
	hit, err := c.Lookup(ctx, hs)
	if err != nil {
		return err
	}
	fmt.Printf("<- lookup: %d of 64 tokens stored\n", hit)

	// A second request with the same prompt loads the stored prefix into
	// fresh blocks (5..8) instead of computing it, before its prefill.
	fresh := []int64{5, 6, 7, 8}[:hit/tokens]
	if _, err := c.Load(ctx, "r2", hs, hit, [][]int64{fresh}); err != nil {
		return err
	}
	for i, id := range fresh {
		b := seg.Bytes()[id*blockBytes : (id+1)*blockBytes]
		if b[0] != byte(i+1) || b[blockBytes-1] != byte(i+1) {
			return fmt.Errorf("loaded block %d holds %d, want %d", id, b[0], i+1)
		}
	}
	fmt.Printf("<- loaded %d tokens into blocks %v\n", hit, fresh)
	return nil
}

func flush(c *client.Client) error {
	if err := c.Flush(); err != nil {
		return err
	}
	fmt.Printf("-> batch %d\n", c.Stats().Seq)
	return nil
}
