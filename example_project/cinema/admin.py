from django.contrib import admin

from .models import Booking


@admin.register(Booking)
class BookingAdmin(admin.ModelAdmin):
    list_display = ["seat", "phone", "created_at", "sms_sent_at", "sms_message_id"]
    list_filter = [("sms_sent_at", admin.EmptyFieldListFilter)]
    search_fields = ["phone", "sms_message_id"]
    readonly_fields = ["created_at", "sms_message_id", "sms_sent_at"]
