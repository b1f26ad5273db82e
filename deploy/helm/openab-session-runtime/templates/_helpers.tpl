{{/* The image of a component: repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "openab.image" -}}
{{ .image.repository }}:{{ .image.tag | default .appVersion }}
{{- end }}

{{/* The admitted installations: the listed ones, or the chart's installation. */}}
{{- define "openab.admittedInstallations" -}}
{{ .Values.admission.installations | default (list .Values.installation) | join " " }}
{{- end }}
