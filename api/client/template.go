package client

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/sandgate/sandgate/api"
)

// TemplatePrefix begins every template id the client makes, and the name
// of every sandbox that builds one.
const TemplatePrefix = "ai-sdk-harness-template"

// Template is a prepared sandbox that new sandboxes start from: a harness
// installed once instead of in every sandbox. It is named by its Identity
// and Setup (TemplateID): a new harness version or other setup commands
// get a template of their own.
type Template struct {
	// Identity names what Prepare makes (the harness and its version).
	Identity string
	// Setup commands run first, in order; one that exits non-zero fails
	// the build.
	Setup []string
	// Prepare, when set, prepares the builder sandbox after Setup (a
	// harness installs itself). It gets the files-and-commands view only.
	Prepare func(ctx context.Context, sb *Restricted) error

	// The builder sandbox's network (not part of the id): the hosts Setup
	// and Prepare may reach (a package registry), as in CreateOptions.
	AllowedHosts  []string
	NetworkPolicy *NetworkPolicy
	BaseURLs      map[string]string
}

// TemplateID is the id of the template of identity and setup, as the
// TypeScript client computes it (protocol 1 §9): "ai-sdk-harness-template-"
// and the first 24 hex digits of the SHA-256 of the JSON array
// [1, identity, [setup...]].
func TemplateID(identity string, setup []string) string {
	var b strings.Builder
	b.WriteString("[1,")
	jsString(&b, identity)
	b.WriteString(",[")
	for i, s := range setup {
		if i > 0 {
			b.WriteByte(',')
		}
		jsString(&b, s)
	}
	b.WriteString("]]")
	sum := sha256.Sum256([]byte(b.String()))
	return TemplatePrefix + "-" + hex.EncodeToString(sum[:])[:24]
}

// jsString writes s as JavaScript's JSON.stringify does, which
// encoding/json does not quite (it escapes <, >, &, U+2028 and U+2029).
func jsString(b *strings.Builder, s string) {
	const hexDigits = "0123456789abcdef"
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		default:
			if r < 0x20 {
				b.WriteString(`\u00`)
				b.WriteByte(hexDigits[r>>4])
				b.WriteByte(hexDigits[r&0xf])
				continue
			}
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
}

// templateBuild is a template being made sure of by this process.
type templateBuild struct {
	done chan struct{}
	err  error
}

// EnsureTemplate makes sure the template exists in the service and
// returns its id. An absent one is built once: a throwaway sandbox runs
// the setup commands and Prepare, is saved as the template, and is always
// destroyed. Concurrent callers of one Client share one build; a failed
// build is not remembered, and the next call tries again.
func (c *Client) EnsureTemplate(ctx context.Context, t Template) (string, error) {
	id := TemplateID(t.Identity, t.Setup)
	c.tmu.Lock()
	b := c.builds[id]
	if b == nil {
		b = &templateBuild{done: make(chan struct{})}
		c.builds[id] = b
		go func() {
			b.err = c.ensureTemplate(ctx, id, t)
			if b.err != nil {
				c.forgetTemplate(id)
			}
			close(b.done)
		}()
	}
	c.tmu.Unlock()
	select {
	case <-b.done:
		return id, b.err
	case <-ctx.Done():
		return "", context.Cause(ctx)
	}
}

// forgetTemplate drops what this process knows of template id: the next
// EnsureTemplate asks the service again.
func (c *Client) forgetTemplate(id string) {
	c.tmu.Lock()
	delete(c.builds, id)
	c.tmu.Unlock()
}

func (c *Client) ensureTemplate(ctx context.Context, id string, t Template) error {
	ok, err := c.TemplateExists(ctx, id)
	if err != nil || ok {
		return err
	}
	var rnd [3]byte
	rand.Read(rnd[:])
	builder := TemplatePrefix + "-" + id[len(id)-8:] + "-" + hex.EncodeToString(rnd[:])
	body, err := networkBody(t.AllowedHosts, t.NetworkPolicy, t.BaseURLs)
	if err != nil {
		return fmt.Errorf("template %s: %w", id, err)
	}
	s, err := c.create(ctx, builder, body, nil)
	if err != nil {
		return fmt.Errorf("template %s: creating its builder: %w", id, err)
	}
	defer func() {
		// Always, whatever happened: the builder is nobody's.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		s.Destroy(dctx)
	}()
	if err := runSetup(ctx, s.r, t.Setup); err != nil {
		return fmt.Errorf("template %s: %w", id, err)
	}
	if t.Prepare != nil {
		if err := t.Prepare(ctx, s.r); err != nil {
			return fmt.Errorf("template %s: preparing it: %w", id, err)
		}
	}
	if _, err := c.doLong(ctx, call{route: routeSaveTemplate, args: []string{builder}, body: jsonBody(map[string]string{"id": id})}, nil); err != nil {
		return fmt.Errorf("template %s: saving it: %w", id, err)
	}
	return nil
}

// TemplateExists reports whether template id is in the service's
// namespace.
func (c *Client) TemplateExists(ctx context.Context, id string) (bool, error) {
	if err := checkName("template", id); err != nil {
		return false, err
	}
	st, err := c.doJSON(ctx, call{route: routeTemplate, args: []string{id}, idempotent: true, ok: []int{http.StatusNotFound}}, nil)
	if err != nil {
		return false, err
	}
	return st == http.StatusOK, nil
}

// Templates lists the templates of the service's namespace.
func (c *Client) Templates(ctx context.Context) ([]TemplateInfo, error) {
	var l api.TemplateList
	if _, err := c.doJSON(ctx, call{route: routeTemplates, idempotent: true}, &l); err != nil {
		return nil, err
	}
	out := make([]TemplateInfo, 0, len(l.Templates))
	for _, t := range l.Templates {
		out = append(out, TemplateInfo{ID: t.ID, Created: t.Created, LayerBytes: t.LayerBytes})
	}
	return out, nil
}

// DeleteTemplate removes template id from the service; a missing one is
// no error. Sandboxes made from it keep what they need of it.
func (c *Client) DeleteTemplate(ctx context.Context, id string) error {
	if err := checkName("template", id); err != nil {
		return err
	}
	if _, err := c.doJSON(ctx, call{route: routeDeleteTemplate, args: []string{id}, idempotent: true}, nil); err != nil {
		return err
	}
	c.forgetTemplate(id)
	return nil
}
