package client_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/messages"
)

// An engine connects with its own inbox prefix, registers, tells the client
// what each scheduler step did and flushes once per step; it reuses a
// request's GPU blocks only after OnReleased names that request.
func Example() {
	nc, err := client.Dial("nats://127.0.0.1:4222", "gpu0")
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	free := make(chan client.Release, 64)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := client.Connect(ctx, nc, client.Config{
		Engine: "gpu0",
		Spec: messages.EngineSpec{TokensPerHash: 16, BlocksPerChunk: 1, NumGPUBlocks: 256,
			Segments: []messages.Segment{{Shm: "gpu0-kv"}},
			Groups: []messages.GroupSpec{{Kind: messages.KindFull, TokensPerBlock: 16,
				Regions: []messages.Region{{BlockStride: 4096, BlockBytes: 4096}}}}},
		OnReleased: func(r client.Release) { free <- r }, // never block for long here
	})
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = c.Close() }()

	// Step 1: a request arrives and gets two blocks. An event the node
	// would reject is refused here, and never released: check each.
	if err := errors.Join(c.Added("r1", 32), c.Blocks("r1", 0, 0, []uint32{1, 2}), c.Flush()); err != nil {
		log.Fatal(err)
	}
	// Step 2: its prefill completed (KV written and fenced); it finished.
	if err := errors.Join(c.Hashes("r1", 0, []byte{0xaa}, []byte{0xbb}), c.Tokens("r1", 32, 32),
		c.Finished("r1", false, 32, 32), c.Flush()); err != nil {
		log.Fatal(err)
	}

	r := <-free // blocks 1 and 2 may be reused now
	fmt.Println(r.Request, r.Reason)
}
