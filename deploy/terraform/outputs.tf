output "url" {
  description = "The service's URL: give it to the AI SDK client with the service token."
  value       = google_cloud_run_v2_service.sandgate.uri
}

output "service_account" {
  description = "The service's identity (objects in the bucket, the token's secret, nothing else)."
  value       = google_service_account.sandgate.email
}

output "bucket" {
  value = google_storage_bucket.store.name
}
