// Command publisher is the smallest engine that speaks kvactors protocol v1:
// it owns one shared-memory segment as its "GPU", registers, runs one request
// through prefill with its hashes lagging a step behind its tokens, finishes
// it, and prints what kvactors answers. Run `kvactors serve` first, then
//
//	go run ./examples/publisher --nats nats://127.0.0.1:4222
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/natsauth"
)

const (
	blockBytes = 4096
	numBlocks  = 256
)

func main() {
	url := flag.String("nats", nats.DefaultURL, "NATS URL of kvactors")
	shmDir := flag.String("shm-dir", "/dev/shm", "kvactors' --shm-dir")
	engine := flag.String("engine", "example", "engine id")
	flag.Parse()

	// An engine reads replies only under its own inbox prefix
	// (docs/SECURITY.md, NATS permissions).
	nc, err := nats.Connect(*url, nats.CustomInboxPrefix(natsauth.InboxPrefix(*engine)))
	if err != nil {
		log.Fatalf("connect: %v", err)
	}
	defer nc.Close()

	// The engine's KV cache: one segment, one group, one region (layer).
	seg, err := shm.Create(*shmDir, *engine+"-kvactors-example", numBlocks*blockBytes)
	if err != nil {
		log.Fatalf("create segment: %v", err)
	}
	defer func() { _ = seg.Remove() }()
	spec := messages.EngineSpec{TokensPerHash: 16, BlocksPerChunk: 1, NumGPUBlocks: numBlocks,
		Segments: []messages.Segment{seg.Spec()},
		Groups: []messages.GroupSpec{{Kind: messages.KindFull, TokensPerBlock: 16,
			Regions: []messages.Region{{Segment: 0, Offset: 0, BlockStride: blockBytes, BlockBytes: blockBytes}}}}}
	request(nc, *engine, "register", spec)

	subject := func(verb string) string { return "kvactors." + *engine + "." + verb }
	// One subscription for both answers, so they print in the order kvactors
	// sent them (every stored of a request comes before its released).
	released := make(chan struct{}, 1)
	if _, err := nc.Subscribe(subject("*"), func(m *nats.Msg) {
		switch verb := m.Subject[len(subject("")):]; verb {
		case "stored", "released":
			fmt.Printf("<- %s %s\n", verb, m.Data)
			if verb == "released" {
				released <- struct{}{}
			}
		}
	}); err != nil {
		log.Fatal(err)
	}

	// One request of 64 tokens: 4 blocks (ids 1..4), allocated up front.
	// Each step computes 16 tokens; its hash is published one step later.
	seq := uint64(0)
	send := func(events ...map[string]any) {
		seq++
		body, _ := json.Marshal(map[string]any{"epoch": fmt.Sprint(os.Getpid()), "seq": seq, "events": events})
		if err := nc.Publish(subject("events"), body); err != nil {
			log.Fatal(err)
		}
		fmt.Printf("-> batch %d: %d events\n", seq, len(events))
	}
	send(map[string]any{"type": "added", "request": "r1", "prompt_tokens": 64},
		map[string]any{"type": "blocks", "request": "r1", "group": 0, "start": 0, "ids": []int{1, 2, 3, 4}})
	for step := 1; step <= 4; step++ {
		// Write the KV of block `step` before announcing it as computed.
		b := seg.Bytes()[step*blockBytes : (step+1)*blockBytes]
		for i := range b {
			b[i] = byte(step)
		}
		events := []map[string]any{{"type": "tokens", "request": "r1", "computed": 16 * step, "total": 64}}
		if step > 1 { // async scheduling: the hash of the previous block arrives now
			events = append(events, map[string]any{"type": "hashes", "request": "r1", "start": step - 2,
				"hashes": []string{fmt.Sprintf("%064x", step-1)}})
		}
		send(events...)
	}
	send(map[string]any{"type": "hashes", "request": "r1", "start": 3, "hashes": []string{fmt.Sprintf("%064x", 4)}},
		map[string]any{"type": "finished", "request": "r1", "aborted": false, "computed": 64, "total": 64})
	select { // the engine may reuse r1's blocks only after released
	case <-released:
	case <-time.After(5 * time.Second):
		log.Fatal("no released within 5s")
	}
	request(nc, *engine, "lookup", map[string]any{"hashes": []string{
		fmt.Sprintf("%064x", 1), fmt.Sprintf("%064x", 2), fmt.Sprintf("%064x", 3), fmt.Sprintf("%064x", 4)}})
}

func request(nc *nats.Conn, engine, verb string, body any) {
	data, _ := json.Marshal(body)
	msg, err := nc.Request("kvactors."+engine+"."+verb, data, 5*time.Second)
	if err != nil {
		log.Fatalf("%s: %v", verb, err)
	}
	fmt.Printf("<- %s reply %s\n", verb, msg.Data)
}
