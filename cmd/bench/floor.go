package main

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/novox/mesh-provisioner/query"
)

// floorSubject is the bare endpoint's subject.
const floorSubject = "bench.floor"

// serveFloor is the bench run as the bare replier (-floor-reply): a micro endpoint in a process of its
// own that answers every request with the same body of n bytes or, given a pages file (writePages),
// with those pages in turn, one a request, until its stdin closes.
func serveFloor(url string, n int, pagesFile string) error {
	pages := [][]byte{make([]byte, n)}
	if pagesFile != "" {
		var err error
		if pages, err = readPages(pagesFile); err != nil {
			return err
		}
	}
	nc, err := nats.Connect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	svc, err := micro.AddService(nc, micro.Config{Name: "bench-floor", Version: "0.0.1"})
	if err != nil {
		return err
	}
	defer func() { _ = svc.Stop() }()
	var asked atomic.Int64
	respond := func(r micro.Request) { _ = r.Respond(pages[int(asked.Add(1)-1)%len(pages)]) }
	if err := svc.AddEndpoint("floor", micro.HandlerFunc(respond), micro.WithEndpointSubject(floorSubject)); err != nil {
		return err
	}
	if err := nc.Flush(); err != nil {
		return err
	}
	fmt.Println("ready")
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n') // the bench closes stdin to stop it
	return nil
}

// startFloor starts the bench's own binary as the bare replier, with args after the server's URL,
// and returns the func that stops it and its process id (for its CPU time, schedstat).
func (b *bench) startFloor(args ...string) (func(), string, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, "", err
	}
	cmd := exec.Command(self, append([]string{"-floor-reply", b.url}, args...)...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, "", err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, "", err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, "", err
	}
	stop := func() {
		_ = stdin.Close()
		_ = cmd.Wait()
	}
	if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || line != "ready\n" {
		stop()
		return nil, "", fmt.Errorf("floor replier did not start: %q %v", line, err)
	}
	return stop, strconv.Itoa(cmd.Process.Pid), nil
}

// replyFloor measures what NATS and two processes alone cost a node lookup: a bare endpoint in another
// process answering a fixed body of the node answer's size, asked as the node lookups are. It returns
// the median and p99, and the replier's CPU time a reply (its threads' run time over the series, as
// seatCPU's): what a bare micro reply of those bytes costs a process, beside the seat's a lookup.
func (b *bench) replyFloor(size int) (time.Duration, time.Duration, time.Duration, error) {
	stop, pid, err := b.startFloor("-floor-bytes", strconv.Itoa(size))
	if err != nil {
		return 0, 0, 0, err
	}
	defer stop()
	body := []byte{0x81, 0xa4, 'w', 'h', 'a', 't', 0xa5, 'n', 'e', 'e', 'd', 's'} // {"what":"needs"}
	times := make([]time.Duration, 0, b.lookups)
	runtime.GC() // as before the node lookups
	cpu0, _ := schedstat(pid)
	for i := 0; i < b.lookups; i++ {
		start := time.Now()
		msg, err := b.nc.Request(floorSubject, body, 10*time.Second)
		if err != nil {
			return 0, 0, 0, err
		}
		times = append(times, time.Since(start))
		if len(msg.Data) != size {
			return 0, 0, 0, fmt.Errorf("floor answer of %d bytes, want %d", len(msg.Data), size)
		}
	}
	cpu1, _ := schedstat(pid)
	cpu := (cpu1 - cpu0) / time.Duration(b.lookups)
	fmt.Fprintf(os.Stderr, "bench: reply floor: p50 %s p90 %s p99 %s max %s; replier CPU %.0f µs a reply\n",
		ms(percentile(times, 0.5)), ms(percentile(times, 0.9)), ms(percentile(times, 0.99)), ms(percentile(times, 1)), float64(cpu)/1e3)
	return percentile(times, 0.5), percentile(times, 0.99), cpu, nil
}

// wideFloor measures what NATS, two processes and the client's reading alone cost a wide lookup (a
// module's or a collection's, which names what): the seat's own MessagePack pages of req, answered in
// turn by a bare endpoint in another process and walked as the wide lookups are (each page read for
// its rows and next before the next request). Dividing the direct watch's median by it gives the
// largest ratio the machine allows for that lookup. Each of those walks is followed by one of the
// verb's, so that the two are compared at the same moments: on this shared machine a bare walk of the
// same pages moved from 0.5 to 3.4 ms between two series seconds apart (docs/performance.md, h149),
// and a floor walked alone in a phase of its own was set against verb walks of another moment.
func (b *bench) wideFloor(figure, what string, req map[string]any, direct time.Duration) error {
	var pages [][]byte
	rows, _, err := b.walk(query.Subject, req, false, func(p []byte) { pages = append(pages, append([]byte(nil), p...)) })
	if err != nil {
		return err
	}
	size := 0
	for _, p := range pages {
		size += len(p)
	}
	file := filepath.Join(b.dir, "floor-pages")
	if err := writePages(file, pages); err != nil {
		return err
	}
	stop, _, err := b.startFloor("-floor-pages", file)
	if err != nil {
		return err
	}
	defer stop()
	walks := 5 * wideRoundsNow()
	floor := make([]time.Duration, 0, walks)
	verb := make([]time.Duration, 0, walks)
	for i := 0; i < walks; i++ {
		for _, w := range []struct {
			subject string
			times   *[]time.Duration
		}{{floorSubject, &floor}, {query.Subject, &verb}} {
			n, t, err := b.walk(w.subject, req, false, nil)
			if err != nil {
				return err
			}
			if n != rows {
				return fmt.Errorf("%s walked %d rows, the seat's pages hold %d", w.subject, n, rows)
			}
			*w.times = append(*w.times, t)
		}
	}
	m, v := percentile(floor, 0.5), percentile(verb, 0.5)
	b.add(figure, fmt.Sprintf("%s median; so a %s lookup can be at most %.1f× faster than the direct watch here; the verb walked in turn with it %s",
		ms(m), what, float64(direct)/float64(m), ms(v)),
		fmt.Sprintf("a bare micro endpoint in another process answering the seat's own MessagePack pages of one %s (pages: %d, rows: %d, %.2f MB), walked as the %s lookups are, %d times: what NATS, two processes and the client's reading alone cost; each walk followed by one of the verb (MessagePack), so that the two are read at the same moments",
			what, len(pages), rows, float64(size)/1e6, what, walks))
	return nil
}

// writePages writes pages to file, each after its length (4 bytes, big-endian).
func writePages(file string, pages [][]byte) error {
	var buf []byte
	for _, p := range pages {
		buf = binary.BigEndian.AppendUint32(buf, uint32(len(p)))
		buf = append(buf, p...)
	}
	return os.WriteFile(file, buf, 0o600)
}

// readPages reads what writePages wrote.
func readPages(file string) ([][]byte, error) {
	buf, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var pages [][]byte
	for len(buf) > 0 {
		if len(buf) < 4 || int(binary.BigEndian.Uint32(buf)) > len(buf)-4 {
			return nil, fmt.Errorf("%s: a page is cut short", file)
		}
		n := int(binary.BigEndian.Uint32(buf))
		pages, buf = append(pages, buf[4:4+n]), buf[4+n:]
	}
	if len(pages) == 0 {
		return nil, fmt.Errorf("%s: no pages", file)
	}
	return pages, nil
}
