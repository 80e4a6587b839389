// Command flooder is chaos test 3's hostile engine, a separate process so
// that it floods at full speed even when the tests run under -race: it
// registers one engine (unless --register=false) and publishes ~256 KiB
// event batches, unpaced, until --bytes are sent, then prints
// "sent <bytes> <seconds>".
package main

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/wire"
)

func main() {
	url := flag.String("nats", "", "NATS URL")
	engine := flag.String("engine", "flood", "engine id")
	shmDir := flag.String("shm-dir", "", "kvactors' --shm-dir")
	total := flag.Int64("bytes", 256<<20, "bytes of batches to send")
	register := flag.Bool("register", true, "register first (false: an earlier run did)")
	flag.Parse()
	if err := run(*url, *engine, *shmDir, *total, *register); err != nil {
		fmt.Fprintln(os.Stderr, "flooder:", err)
		os.Exit(1)
	}
}

func run(url, engine, shmDir string, total int64, register bool) (err error) {
	nc, err := client.Dial(url, engine)
	if err != nil {
		return err
	}
	defer nc.Close()
	if register {
		if err := registerEngine(nc, engine, shmDir); err != nil {
			return err
		}
	}
	var b wire.Batch
	b.Added("x", 1<<18)
	b.BeginHashes("x", 0)
	for i := range 3800 { // about 256 KiB of hex
		var k [8]byte
		binary.BigEndian.PutUint64(k[:], uint64(i))
		h := sha256.Sum256(k[:])
		b.Hash(h[:])
	}
	b.EndHashes()
	var buf []byte
	sent := int64(0)
	start := time.Now()
	subject := "kvactors." + engine + ".events"
	for seq := uint64(1); sent < total; seq++ {
		buf = b.Body(buf, "flood-epoch", seq)
		if err := nc.Publish(subject, buf); err != nil {
			return err
		}
		sent += int64(len(buf))
	}
	if err := nc.Flush(); err != nil {
		return err
	}
	fmt.Printf("sent %d %.3f\n", sent, time.Since(start).Seconds())
	return nil
}

// registerEngine creates the engine's segment and registers it. The
// segment is removed when the process exits; the node keeps its mapping.
func registerEngine(nc *nats.Conn, engine, shmDir string) error {
	seg, err := shm.Create(shmDir, engine+"-kv", 1<<20)
	if err != nil {
		return err
	}
	defer func() { _ = seg.Remove() }()
	spec := messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 1 << 16,
		Segments: []messages.Segment{seg.Spec()},
		Groups: []messages.GroupSpec{{Kind: messages.KindFull, TokensPerBlock: 4,
			Regions: []messages.Region{{BlockStride: 16, BlockBytes: 16}}}}}
	body, _ := json.Marshal(spec)
	m, err := nc.Request("kvactors."+engine+".register", body, 5*time.Second)
	if err != nil {
		return fmt.Errorf("register: %w", err)
	}
	var reg messages.RegisterReply
	if err := json.Unmarshal(m.Data, &reg); err != nil || !reg.OK {
		return fmt.Errorf("register: %s", m.Data)
	}
	return nil
}
