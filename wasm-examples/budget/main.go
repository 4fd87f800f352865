// Command budget is an http-wasm module for sandgate that refuses requests
// whose body is larger than a configured number of bytes, with 413 and a
// reason in the audit event.
//
// Config (config.txt, passed inline after "?"): the largest body allowed,
// in bytes: a decimal number, optionally with a KiB or MiB suffix ("4096",
// "64KiB", "1MiB").
//
// A request that declares its length (Content-Length) is decided on that
// alone, without reading the body. Only a request without one (a chunked
// body, or none) makes the module enable buffer_request, for that request
// only, and read at most one byte more than the budget; the upstream still
// receives the whole body. It imports sandgate.refuse,
// so it runs only on sandgate's proxy.
package main

import (
	"io"
	"strconv"
	"strings"

	"github.com/sandgate/sandgate/transforms/wasm/guest"
	"github.com/sandgate/sandgate/transforms/wasm/guest/sandgate"
)

func main() {}

func init() {
	budget, err := parseSize(string(guest.Config()))
	if err != nil {
		guest.Abort("budget: " + err.Error())
	}
	limit := strconv.FormatInt(budget, 10)
	guest.HandleRequest(func(req guest.Request, _ guest.Response) (bool, uint32) {
		h := req.Header()
		if cl := h.Get("content-length"); cl != "" {
			n, err := strconv.ParseInt(cl, 10, 64)
			if err == nil && n <= budget {
				return true, 0
			}
			if err == nil {
				sandgate.Refuse(413, "request body of "+cl+" bytes is over the budget of "+limit+" bytes")
				return false, 0
			}
			// A malformed length is the host's to refuse; measure the body.
		}
		if !guest.EnableFeatures(guest.FeatureBufferRequest).Has(guest.FeatureBufferRequest) {
			sandgate.Refuse(413, "request body of unknown length and the host cannot buffer it to measure it")
			return false, 0
		}
		n, err := io.Copy(io.Discard, io.LimitReader(req.Body(), budget+1))
		if err != nil {
			guest.Abort("budget: reading the request body: " + err.Error())
		}
		if n > budget {
			sandgate.Refuse(413, "request body is over the budget of "+limit+" bytes")
			return false, 0
		}
		return true, 0
	})
}

// parseSize reads "4096", "64KiB" or "1MiB".
func parseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}} {
		if rest, ok := strings.CutSuffix(s, u.suffix); ok {
			s, mult = strings.TrimSpace(rest), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 || n > (1<<40)/mult {
		return 0, sizeError(`config must be the largest body in bytes, e.g. "4096" or "64KiB"; got "` + s + `"`)
	}
	return n * mult, nil
}

// sizeError is a config the module cannot use.
type sizeError string

func (e sizeError) Error() string { return string(e) }
