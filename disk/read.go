package disk

import (
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvactors/kvactors/messages"
)

// groupBytes is the most data one preadv of records lying back to back
// takes before their checksums are taken, so the CRC reads bytes still in
// cache (L2-sized).
const groupBytes = 512 << 10

// maxIovecs is the most buffers one preadv takes (Linux's IOV_MAX).
const maxIovecs = 1024

// check counts a hit if key's read went well and its bytes match the
// record's checksum; otherwise the key is dropped (or was already: a segment
// deleted while it was read) and the error says so.
func (d *Disk) check(engine string, key messages.Key, it *item, sum uint32, err error) error {
	if err != nil {
		if !d.dropItem(engine, it) { // dropped (its segment deleted) or replaced while we read
			return fmt.Errorf("%w: key %x", ErrMissing, string(key))
		}
		return fmt.Errorf("%w: key %x: %v", ErrCorrupt, string(key), err)
	}
	if sum != it.sum {
		if !d.dropItem(engine, it) { // replaced while we read: these bytes were the old record's
			return fmt.Errorf("%w: key %x", ErrMissing, string(key))
		}
		return fmt.Errorf("%w: key %x: checksum %08x, stored %08x", ErrCorrupt, string(key), sum, it.sum)
	}
	d.hits.Add(1)
	return nil
}

// ReadMany reads a load's keys: keys[i]'s bytes into dst[i], in order (the
// host extents its load made room for), checked against the record's
// checksum, which goes to sums[i]. The bytes go straight into dst, no buffer
// in between. Records that lie back to back in a segment, in keys' order,
// are read together with one preadv (their headers into a scratch buffer),
// up to groupBytes, and each is checked before the next group is read; any
// other record is read and checked alone. On failure it returns the index of
// the key that failed, and an error: ErrMissing for a missing chunk,
// ErrCorrupt for a corrupt or unreadable one, which is dropped (Notify hears
// it as removed, for engine if the chunk was found at open); the keys before
// it were read and checked.
func (d *Disk) ReadMany(engine string, keys []messages.Key, dst [][][]byte, sums []uint32) (int, error) {
	start := time.Now()
	its := make([]*item, len(keys))
	d.mu.Lock()
	for i, k := range keys {
		it, ok := d.items[k]
		if !ok {
			d.mu.Unlock()
			return i, fmt.Errorf("%w: key %x", ErrMissing, string(k))
		}
		d.lru.MoveToBack(it.elem)
		its[i] = it
	}
	d.mu.Unlock()
	for i, it := range its {
		if want := extentBytes(dst[i]); want != it.size {
			return i, fmt.Errorf("disk: key %x: %d bytes on disk, %d asked", string(keys[i]), it.size, want)
		}
	}
	var read int64
	defer func() {
		d.readBytes.Add(read)
		d.readNanos.Add(int64(time.Since(start)))
	}()
	for lo := 0; lo < len(keys); {
		hi, n, iovs := lo+1, its[lo].size, len(dst[lo])
		for hi < len(keys) && its[hi].seg == its[hi-1].seg &&
			its[hi].off == its[hi-1].off+its[hi-1].size+headerLen(keys[hi]) &&
			n+its[hi].size <= groupBytes && iovs+1+len(dst[hi]) <= maxIovecs {
			n, iovs = n+its[hi].size, iovs+1+len(dst[hi])
			hi++
		}
		together := hi-lo > 1 && readv(its[lo].seg.f, keys[lo:hi], dst[lo:hi], its[lo].off) == nil
		for i := lo; i < hi; i++ {
			var err error
			if together {
				sums[i] = checksum(dst[i])
			} else {
				sums[i], err = readOne(its[i], dst[i])
			}
			if err = d.check(engine, keys[i], its[i], sums[i], err); err != nil {
				return i, err
			}
			read += its[i].size
		}
		lo = hi
	}
	return len(keys), nil
}

// readOne reads it's data into dst, an extent per call, each checksummed
// after its read (reading a large extent a tile at a time, to checksum each
// tile from cache, measured no faster here: docs/BENCHMARKS.md).
func readOne(it *item, dst [][]byte) (uint32, error) {
	var sum uint32
	off := it.off
	for _, b := range dst {
		if _, err := it.seg.f.ReadAt(b, off); err != nil {
			return 0, err
		}
		sum = crc32.Update(sum, castagnoli, b)
		off += int64(len(b))
	}
	return sum, nil
}

// readv reads records lying back to back in f, from the first one's data at
// off, into dst (their data) with one preadv; the headers between them go to
// a scratch buffer. Any error or short read is an error: the caller then
// reads them one at a time, which tells what went wrong.
func readv(f *os.File, keys []messages.Key, dst [][][]byte, off int64) error {
	var skip int64
	for _, k := range keys[1:] {
		skip = max(skip, headerLen(k))
	}
	scratch := make([]byte, skip)
	var iovs [][]byte
	var want int
	for i, ext := range dst {
		if i > 0 {
			iovs = append(iovs, scratch[:headerLen(keys[i])])
			want += int(headerLen(keys[i]))
		}
		for _, b := range ext {
			iovs = append(iovs, b)
			want += len(b)
		}
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var n int
	var rerr error
	if err := rc.Read(func(fd uintptr) bool {
		n, rerr = unix.Preadv(int(fd), iovs, off)
		return true
	}); err != nil {
		return err
	}
	if rerr != nil {
		return rerr
	}
	if n != want {
		return io.ErrUnexpectedEOF
	}
	return nil
}

func headerLen(key messages.Key) int64 { return int64(fixedHeader + len(key) + 4) }

func extentBytes(dst [][]byte) int64 {
	var n int64
	for _, b := range dst {
		n += int64(len(b))
	}
	return n
}

func checksum(dst [][]byte) uint32 {
	var sum uint32
	for _, b := range dst {
		sum = crc32.Update(sum, castagnoli, b)
	}
	return sum
}
