variable "project" {
  description = "The Google Cloud project id."
  type        = string
}

variable "region" {
  description = "The region of the service and of the bucket (same region: every suspend and resume moves a layer)."
  type        = string
}

variable "service_name" {
  description = "The Cloud Run service's name; with shards, the first shard's (the others add -1, -2, ...)."
  type        = string
  default     = "sandgate"
}

variable "shards" {
  description = "How many shards: Cloud Run services of one instance each, over the one bucket, each running its own sandboxes. Any shard answers any request; give protocol 1's clients any one URL, the Go client all of them (output urls)."
  type        = number
  default     = 1
  validation {
    condition     = var.shards >= 1 && floor(var.shards) == var.shards
    error_message = "shards is a whole number, 1 or more."
  }
}

variable "repository" {
  description = "The Artifact Registry repository Terraform makes for the image (REGION-docker.pkg.dev/PROJECT/REPOSITORY)."
  type        = string
  default     = "sandgate"
}

variable "image" {
  description = "The image to run, by digest: REGION-docker.pkg.dev/PROJECT/REPOSITORY/sandgate@sha256:... (yours, built FROM sandgate's, if you add tools), pushed to the repository after the first apply (README.md)."
  type        = string
  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.image))
    error_message = "Give the image by digest (...@sha256:<64 hex>): the digest is also SANDBOX_IMAGE_ID, the template namespace's input."
  }
}

variable "bucket_name" {
  description = "The bucket for snapshots and templates (globally unique)."
  type        = string
}

variable "template_max_age_days" {
  description = "Age, counted from a template's creation, after which objects under templates/ are deleted by a lifecycle rule; 0 (the default) for no rule. The rule also removes templates still in use: a sandbox made from a template and suspended can then no longer be resumed (its snapshot is a delta onto the template's layer), however recently it was suspended. Set it only if every sandbox made from a template is resumed or destroyed within that many days of the template's creation."
  type        = number
  default     = 0
}

variable "cpu" {
  description = "CPUs of each shard's instance (Cloud Run needs more CPUs for more memory)."
  type        = string
  default     = "4"
}

variable "memory" {
  description = "Memory of each shard's instance: about 1 GiB per running agent sandbox, plus about 1 GiB for sandgate and the layers passing through its state directory (memory on Cloud Run)."
  type        = string
  default     = "8Gi"
}

variable "concurrency" {
  description = "Requests at once on each shard's instance: every exec stream, wait and port tunnel of every session is one, and so is every request a shard forwards to another."
  type        = number
  default     = 250
}

variable "min_instances" {
  description = "Per shard: 0 lets Cloud Run stop an idle shard's instance (sandgate saves its sandboxes and releases their leases first); 1 keeps it."
  type        = number
  default     = 0
}

variable "env" {
  description = "More of the service's settings (protocol 1's SANDBOX_ALLOWED_HOSTS, SANDBOX_BASE_URLS, ..., and sandgate's own: SANDGATE_LEASE_TIME, SANDGATE_LEASE_RENEW, SANDGATE_CHECKPOINT_INTERVAL, ...), the same in every shard. Never SANDBOX_ALLOW_PRIVATE_NETWORK or SANDBOX_ALLOW_PRIVATE: sandgate refuses them on Cloud Run."
  type        = map(string)
  default     = {}
}

variable "token_secret_id" {
  description = "The Secret Manager secret holding the service token (SANDBOX_SERVICE_TOKEN). Terraform creates the secret, not its value: add a version out of band (see README.md), so the token is never in Terraform's state."
  type        = string
  default     = "sandgate-service-token"
}

variable "invokers" {
  description = "Who may call the service, every shard of it (roles/run.invoker), e.g. [\"serviceAccount:my-app@PROJECT.iam.gserviceaccount.com\"]."
  type        = list(string)
  default     = []
}
