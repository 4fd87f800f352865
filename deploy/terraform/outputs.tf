output "url" {
  description = "The (first shard's) URL: give it to the AI SDK client with the service token; any shard's URL serves every sandbox."
  value       = local.shard_urls[0]
}

output "urls" {
  description = "Every shard's URL, as each announces itself: give them all to the Go client (client.New(urls...)), which calls each sandbox's owner directly."
  value       = local.shard_urls
}

output "service_account" {
  description = "The shards' identity (objects in the bucket, the token's secret, invoking the shards; nothing else)."
  value       = google_service_account.sandgate.email
}

output "bucket" {
  value = google_storage_bucket.store.name
}

output "repository" {
  description = "Where to push the image: REGION-docker.pkg.dev/PROJECT/REPOSITORY."
  value       = "${var.region}-docker.pkg.dev/${var.project}/${google_artifact_registry_repository.images.repository_id}"
}
